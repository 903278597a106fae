/* One rank of bench/scale.py's OpenMPI side: the same measurements as nexar/examples/scale.rs
 * (time to MPI_Init, the first allreduce of 1 Mi f64, a steady 4 KiB allreduce as the slowest
 * rank sees it, PSS), one JSON line per rank. Liveness messages: OpenMPI sends none of its own.
 *
 *     mpicc -O2 -o /tmp/mpi_scale bench/mpi_scale.c
 *     mpirun --oversubscribe -n 64 /tmp/mpi_scale
 */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static long pss_kib(void) {
    FILE *f = fopen("/proc/self/smaps_rollup", "r");
    char line[256];
    long kib = 0;
    if (!f) return 0;
    while (fgets(line, sizeof line, f))
        if (strncmp(line, "Pss:", 4) == 0) kib = atol(line + 4);
    fclose(f);
    return kib;
}

static int by_value(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    double start = now();
    MPI_Init(&argc, &argv);
    double formed = now() - start;
    int me, world;
    MPI_Comm_rank(MPI_COMM_WORLD, &me);
    MPI_Comm_size(MPI_COMM_WORLD, &world);

    size_t n = 1 << 20;
    double *big = malloc(n * sizeof *big);
    for (size_t i = 0; i < n; i++) big[i] = 1.0;
    double t = now();
    MPI_Allreduce(MPI_IN_PLACE, big, (int)n, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
    double first = now() - t;

    int iterations = getenv("SCALE_ITERATIONS") ? atoi(getenv("SCALE_ITERATIONS")) : 200;
    float small[1024];
    for (int i = 0; i < 1024; i++) small[i] = 1.0f;
    for (int i = 0; i < 20; i++) MPI_Allreduce(MPI_IN_PLACE, small, 1024, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    double *times = malloc(iterations * sizeof *times);
    for (int i = 0; i < iterations; i++) {
        t = now();
        MPI_Allreduce(MPI_IN_PLACE, small, 1024, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        times[i] = now() - t;
    }
    MPI_Allreduce(MPI_IN_PLACE, times, iterations, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    qsort(times, iterations, sizeof *times, by_value);
    printf("{\"rank\":%d,\"world\":%d,\"form_s\":%.3f,\"first_allreduce_s\":%.4f,\"steady_4k_median_us\":%.1f,"
           "\"steady_4k_p99_us\":%.1f,\"pss_kib\":%ld,\"liveness_per_s\":0,\"dead\":0}\n",
           me, world, formed, first, times[iterations / 2] * 1e6, times[(int)((iterations - 1) * 0.99 + 0.5)] * 1e6,
           pss_kib());
    fflush(stdout);
    /* As long idle as nexar's rank (it counts its liveness messages then): equal wall times. */
    int idle = getenv("SCALE_IDLE_S") ? atoi(getenv("SCALE_IDLE_S")) : 5;
    struct timespec pause = {idle, 0};
    nanosleep(&pause, NULL);
    MPI_Barrier(MPI_COMM_WORLD);
    MPI_Finalize();
    return 0;
}
