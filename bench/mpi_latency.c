/* OpenMPI's small-message latency spread, to set beside `nexar-bench -I`: a 4 KiB
 * MPI_Allreduce (1024 floats, sum) and MPI_Barrier, each timed per iteration; the slowest
 * rank's time of each iteration, then p50, p99, the largest and the share of iterations over
 * ten times the median. bench/busy.py runs it under each background load.
 *
 *   mpicc -O3 -o /tmp/mpi_latency bench/mpi_latency.c
 *   mpirun --allow-run-as-root --mca btl tcp,self --mca btl_tcp_if_include lo -np 2 /tmp/mpi_latency 1000
 */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>

#define WARMUP 50

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static void report(const char *name, double *t, int n, int rank) {
    double *slowest = malloc(sizeof(double) * n);
    MPI_Reduce(t, slowest, n, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
    if (rank == 0) {
        qsort(slowest, n, sizeof(double), cmp);
        double p50 = slowest[n / 2];
        int p99 = (int)((n * 99 + 99) / 100) - 1, over = 0;
        for (int i = 0; i < n; i++) over += slowest[i] > 10 * p50;
        printf("%-16s p50_us %.2f p99_us %.2f max_us %.2f over_10x_pct %.2f\n", name, p50 * 1e6,
               slowest[p99] * 1e6, slowest[n - 1] * 1e6, 100.0 * over / n);
    }
    free(slowest);
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank, n = argc > 1 ? atoi(argv[1]) : 1000;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    float *buf = calloc(1024, sizeof(float));
    double *t = malloc(sizeof(double) * n);
    for (int i = 0; i < WARMUP; i++) MPI_Allreduce(MPI_IN_PLACE, buf, 1024, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    MPI_Barrier(MPI_COMM_WORLD);
    for (int i = 0; i < n; i++) {
        double s = MPI_Wtime();
        MPI_Allreduce(MPI_IN_PLACE, buf, 1024, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        t[i] = MPI_Wtime() - s;
    }
    report("allreduce_4KiB", t, n, rank);
    for (int i = 0; i < WARMUP; i++) MPI_Barrier(MPI_COMM_WORLD);
    for (int i = 0; i < n; i++) {
        double s = MPI_Wtime();
        MPI_Barrier(MPI_COMM_WORLD);
        t[i] = MPI_Wtime() - s;
    }
    report("barrier", t, n, rank);
    free(buf);
    free(t);
    MPI_Finalize();
    return 0;
}
