// How fast this machine moves bytes through a ring shared by two processes, without nexar:
// one process, on CPU 0, copies 1 MiB segments of a 64 MiB buffer into a 4 MiB shared ring
// (the size of nexar's same-host rings), the other, on CPU 1, copies them out into a 64 MiB
// buffer of its own, 20 times over. It prints each side's copy rate (time inside memcpy only)
// and the rate of the whole stream. On the 2-core CI-type virtual machine the copy *into* the
// ring, whose cache lines the other core read last, ran at 10.6-12.9 GB/s in some periods and
// at 3.5-3.8 GB/s in others (the copy out stayed at 8-9), for minutes at a time: nexar's
// large same-host transfers swing with it.
//
//   cc -O2 -o /tmp/shm_copy_probe bench/shm_copy_probe.c
//   for i in 1 2 3 4 5; do /tmp/shm_copy_probe; done
#define _GNU_SOURCE
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define BIG (64ul << 20)
#define RING (4ul << 20)
#define SEG (1ul << 20)
#define ROUNDS 20

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static void pin(int cpu) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    if (sched_setaffinity(0, sizeof set, &set) != 0) perror("sched_setaffinity");
}

static double rate(double seconds) { return (double)BIG * ROUNDS / seconds / 1e9; }

int main(void) {
    char *map = mmap(0, 4096 + RING, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (map == MAP_FAILED) {
        perror("mmap");
        return 1;
    }
    // Bytes ever written and ever read, on cache lines of their own.
    _Atomic unsigned long *head = (void *)map, *tail = (void *)(map + 128);
    char *ring = map + 4096;
    pid_t child = fork();
    if (child == 0) {
        pin(1);
        char *dst = malloc(BIG);
        memset(dst, 0, BIG);
        unsigned long read = 0;
        double copying = 0;
        for (int r = 0; r < ROUNDS; r++)
            for (size_t at = 0; at < BIG; at += SEG) {
                while (atomic_load(head) < read + SEG) {}
                double t = now();
                memcpy(dst + at, ring + read % RING, SEG);
                copying += now() - t;
                read += SEG;
                atomic_store(tail, read);
            }
        printf("out of the ring %.1f GB/s, ", rate(copying));
        fflush(stdout);
        return 0;
    }
    pin(0);
    char *src = malloc(BIG);
    memset(src, 1, BIG);
    unsigned long written = 0;
    double start = now(), copying = 0;
    for (int r = 0; r < ROUNDS; r++)
        for (size_t at = 0; at < BIG; at += SEG) {
            while (written + SEG - atomic_load(tail) > RING) {}
            double t = now();
            memcpy(ring + written % RING, src + at, SEG);
            copying += now() - t;
            written += SEG;
            atomic_store(head, written);
        }
    waitpid(child, 0, 0);
    printf("into the ring %.1f GB/s, stream %.2f GB/s\n", rate(copying), rate(now() - start));
    return 0;
}
