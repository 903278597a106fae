// Why the TCP lane uses one connection per link: two processes exchange a 48-byte message,
// as a barrier does (both send, then both wait for the other's), over one TCP connection
// or over two one-way connections, spinning on non-blocking reads. Over two connections
// each received message costs its receiver a pure ACK through the loopback path before its
// read returns; over one, the ACK rides on the next message.
//
//   cc -O2 -o /tmp/tcp_exchange_probe bench/tcp_exchange_probe.c
//   for i in 1 2 3 4 5; do /tmp/tcp_exchange_probe 1; /tmp/tcp_exchange_probe 2; done
#include <arpa/inet.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static struct sockaddr_in loopback(int port) {
    struct sockaddr_in a = {0};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(port);
    return a;
}

static void nodelay(int s) {
    int one = 1;
    setsockopt(s, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

static int listener(int *port) {
    int s = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = loopback(0);
    socklen_t len = sizeof a;
    if (s < 0 || bind(s, (void *)&a, sizeof a) || listen(s, 4) || getsockname(s, (void *)&a, &len)) {
        perror("listen");
        exit(1);
    }
    *port = ntohs(a.sin_port);
    return s;
}

static int dial(int port) {
    int s = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = loopback(port);
    if (s < 0 || connect(s, (void *)&a, sizeof a)) {
        perror("connect");
        exit(1);
    }
    nodelay(s);
    return s;
}

static int answer(int l) {
    int s = accept(l, 0, 0);
    if (s < 0) {
        perror("accept");
        exit(1);
    }
    nodelay(s);
    return s;
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/// `n` exchanges after 1000 warm-ups; prints the mean when `who` is set.
static void exchange(int out, int in, int n, const char *who) {
    char buf[48] = {0};
    double start = 0;
    for (int i = 0; i < n + 1000; i++) {
        if (i == 1000) start = now();
        if (send(out, buf, sizeof buf, 0) != (ssize_t)sizeof buf) {
            perror("send");
            exit(1);
        }
        for (size_t got = 0; got < sizeof buf;) {
            ssize_t r = recv(in, buf + got, sizeof buf - got, MSG_DONTWAIT);
            if (r > 0) got += (size_t)r;
            else if (r == 0) exit(1);
        }
    }
    if (who) printf("%-28s %.2f us per exchange\n", who, (now() - start) / n * 1e6);
}

int main(int argc, char **argv) {
    int connections = argc > 1 ? atoi(argv[1]) : 1, n = 200000, p1, p2;
    int l1 = listener(&p1), l2 = listener(&p2);
    if (fork() == 0) {
        if (connections == 1) {
            int s = dial(p1);
            exchange(s, s, n, NULL);
        } else {
            int out = dial(p1), in = answer(l2);
            exchange(out, in, n, NULL);
        }
        return 0;
    }
    if (connections == 1) {
        int s = answer(l1);
        exchange(s, s, n, "one connection");
    } else {
        int in = answer(l1), out = dial(p2);
        exchange(out, in, n, "two one-way connections");
    }
    wait(NULL);
    return 0;
}
