/* OpenMPI's point-to-point figures in the shapes `nexar-bench` times, at np 2:
 *   sendrecv  each rank sends to the other and receives from it at once (MPI_Sendrecv), as
 *             `nexar-bench --op sendrecv`;
 *   pingpong  rank 0 sends, rank 1 sends the message back; half the round trip, as
 *             `nexar-bench --op pingpong`.
 * Sizes 8 B to 64 MiB (x4 from 4 KiB); per size the slowest rank's time of each iteration,
 * then the median over iterations. One line per size: `<op> <bytes> <median_us>`.
 * bench/compare_p2p.py alternates it with nexar-bench.
 *
 *   mpicc -O3 -o /tmp/mpi_p2p bench/mpi_p2p.c
 *   mpirun --allow-run-as-root --mca btl tcp,self --mca btl_tcp_if_include lo -np 2 /tmp/mpi_p2p
 */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* The median over iterations of the slowest rank's time, on rank 0 (0 elsewhere). */
static double median_of_slowest(double *t, int n, int rank) {
    double *slowest = malloc(sizeof(double) * n), med = 0;
    MPI_Reduce(t, slowest, n, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
    if (rank == 0) {
        qsort(slowest, n, sizeof(double), cmp);
        med = slowest[n / 2];
    }
    free(slowest);
    return med;
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank, np;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &np);
    if (np != 2) {
        if (rank == 0) fprintf(stderr, "mpi_p2p runs with -np 2\n");
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    const size_t max = (size_t)64 << 20;
    char *out = malloc(max), *in = malloc(max);
    memset(out, 1, max);
    memset(in, 0, max);
    double *t = malloc(sizeof(double) * 1000);
    int peer = 1 - rank;
    for (int op = 0; op < 2; op++) {
        size_t sizes[16];
        int nsizes = 0;
        sizes[nsizes++] = 8;
        for (size_t s = 4096; s <= max; s *= 4) sizes[nsizes++] = s;
        for (int k = 0; k < nsizes; k++) {
            size_t bytes = sizes[k];
            int iters = bytes <= (64 << 10) ? 1000 : bytes <= (1 << 20) ? 100 : 20;
            int warmup = iters / 10;
            MPI_Barrier(MPI_COMM_WORLD);
            for (int i = 0; i < warmup + iters; i++) {
                double t0 = MPI_Wtime();
                if (op == 0) {
                    MPI_Sendrecv(out, (int)bytes, MPI_BYTE, peer, 7, in, (int)bytes, MPI_BYTE, peer, 7,
                                 MPI_COMM_WORLD, MPI_STATUS_IGNORE);
                } else if (rank == 0) {
                    MPI_Send(out, (int)bytes, MPI_BYTE, peer, 8, MPI_COMM_WORLD);
                    MPI_Recv(in, (int)bytes, MPI_BYTE, peer, 8, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
                } else {
                    MPI_Recv(in, (int)bytes, MPI_BYTE, peer, 8, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
                    MPI_Send(in, (int)bytes, MPI_BYTE, peer, 8, MPI_COMM_WORLD);
                }
                double dt = MPI_Wtime() - t0;
                if (i >= warmup) t[i - warmup] = op == 0 ? dt : dt / 2;
            }
            double med = median_of_slowest(t, iters, rank);
            if (rank == 0) printf("%s %zu %.2f\n", op == 0 ? "sendrecv" : "pingpong", bytes, med * 1e6);
        }
    }
    free(out);
    free(in);
    free(t);
    MPI_Finalize();
    return 0;
}
