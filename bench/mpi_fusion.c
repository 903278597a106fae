/* OpenMPI's gain from fusing: 100 separate MPI_Allreduce calls of 10,000 floats against one
 * of 1,000,000, the same shape as `nexar-bench --op plan`. Median over iterations of the
 * slowest rank.
 *
 *   mpicc -O3 -o /tmp/mpi_fusion bench/mpi_fusion.c
 *   mpirun --allow-run-as-root --mca btl tcp,self --mca btl_tcp_if_include lo -np 2 /tmp/mpi_fusion
 */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>

#define TENSORS 100
#define LEN 10000
#define ITERS 50
#define WARMUP 5

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median_us(double *t) {
    qsort(t, ITERS, sizeof(double), cmp);
    return t[ITERS / 2] * 1e6;
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    float *flat = malloc(sizeof(float) * TENSORS * LEN);
    for (int i = 0; i < TENSORS * LEN; i++) flat[i] = (float)(rank + i % 7);
    double fused[ITERS], separate[ITERS];
    for (int mode = 0; mode < 2; mode++) {
        for (int i = 0; i < WARMUP + ITERS; i++) {
            MPI_Barrier(MPI_COMM_WORLD);
            double start = MPI_Wtime();
            if (mode == 0) {
                MPI_Allreduce(MPI_IN_PLACE, flat, TENSORS * LEN, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
            } else {
                for (int t = 0; t < TENSORS; t++)
                    MPI_Allreduce(MPI_IN_PLACE, flat + t * LEN, LEN, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
            }
            double took = MPI_Wtime() - start, slowest;
            MPI_Allreduce(&took, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
            if (i >= WARMUP) (mode == 0 ? fused : separate)[i - WARMUP] = slowest;
        }
    }
    if (rank == 0) {
        double f = median_us(fused), s = median_us(separate);
        printf("fused %.1f us, separate %.1f us, speed-up %.2fx\n", f, s, s / f);
    }
    free(flat);
    MPI_Finalize();
    return 0;
}
