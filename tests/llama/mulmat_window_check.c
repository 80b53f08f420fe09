/* A verify window's rows against single rows, one matrix product at a time, through ggml's own
 * graph (the CPU backend's mul_mat op, its chunking and kernel choice included): for a weight type,
 * W (M x K, random, quantized by ggml) times N activation rows must give, for every row, bit for
 * bit what W times that row alone gives (a decoding step), for N = 2..64 (every verify window and
 * batched round within mars-local's exact bound, patches/0003); and each row alone must be W times it
 * (dequantized, in double precision) within what 8-bit activations can move a sum.  Built against the installed
 * llama-cpp-python's ggml by tests/llama/test_c_kernels.py; also cross-built for CPUs this machine
 * is not (an aarch64 build run under qemu-user: BENCHMARKS.md, "ARM").  Prints what differs,
 * exit status 1 if anything does.
 *
 *   mulmat_window_check TYPE [THREADS [K [M [ROWS...]]]]
 *
 * TYPE: a ggml type name (f16, q8_0, q4_K, ...); ROWS: the batch sizes to check instead of
 * 2-64 (a prompt's 65+ rows take other kernels, which a test uses to see the check fail).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ggml.h"
#include "ggml-cpu.h"

static int WINDOWS[32] = {2, 3, 4, 5, 8, 9, 16, 17, 24, 33, 64};
static int N_WINDOWS = 11;

static float frand(void) { return rand() / (float) RAND_MAX - 0.5f; }

/* W times the first n rows of x (K floats each): M outputs per row, written to out[r * M + i]. */
static void product(enum ggml_type type, const void * wq, int K, int M, const float * x, int n, int threads,
                    float * out) {
    size_t wbytes = ggml_row_size(type, K) * M;
    struct ggml_init_params ip = {wbytes + (size_t) K * n * 4 + (size_t) M * n * 4 + 16 * 1024 * 1024, NULL, false};
    struct ggml_context * ctx = ggml_init(ip);
    struct ggml_tensor * w = ggml_new_tensor_2d(ctx, type, K, M);
    memcpy(w->data, wq, wbytes);
    struct ggml_tensor * a = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, K, n);
    memcpy(a->data, x, (size_t) K * n * 4);
    struct ggml_tensor * y = ggml_mul_mat(ctx, w, a);
    struct ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, y);
    if (ggml_graph_compute_with_ctx(ctx, gf, threads) != GGML_STATUS_SUCCESS) {
        fprintf(stderr, "graph compute failed\n");
        exit(2);
    }
    memcpy(out, y->data, (size_t) M * n * 4);
    ggml_free(ctx);
}

int main(int argc, char ** argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s TYPE [THREADS [K [M [ROWS...]]]]\n", argv[0]);
        return 2;
    }
    enum ggml_type type = GGML_TYPE_COUNT;
    for (int t = 0; t < GGML_TYPE_COUNT; t++) {
        const char * name = ggml_type_name((enum ggml_type) t);
        if (name && strcmp(name, argv[1]) == 0) type = (enum ggml_type) t;
    }
    if (type == GGML_TYPE_COUNT) {
        fprintf(stderr, "unknown type %s\n", argv[1]);
        return 2;
    }
    int threads = argc > 2 ? atoi(argv[2]) : 2;
    int K = argc > 3 ? atoi(argv[3]) : 2048;  /* a multiple of 256 (K-quant blocks) */
    int M = argc > 4 ? atoi(argv[4]) : 512;   /* larger than one 16-row chunk per thread */
    if (argc > 5) {
        N_WINDOWS = 0;
        for (int i = 5; i < argc && N_WINDOWS < 32; i++) WINDOWS[N_WINDOWS++] = atoi(argv[i]);
    }
    int nmax = 1;
    for (int i = 0; i < N_WINDOWS; i++) {
        if (WINDOWS[i] < 1) {
            fprintf(stderr, "rows must be >= 1\n");
            return 2;
        }
        nmax = WINDOWS[i] > nmax ? WINDOWS[i] : nmax;
    }
    ggml_cpu_init();
    srand(1);
    float * wf = malloc(sizeof(float) * K * M);
    for (size_t i = 0; i < (size_t) K * M; i++) wf[i] = frand() * 0.1f;
    void * wq = malloc(ggml_row_size(type, K) * M);
    ggml_quantize_chunk(type, wf, wq, 0, M, K, NULL);
    float * x = malloc(sizeof(float) * K * nmax);
    for (size_t i = 0; i < (size_t) K * nmax; i++) x[i] = frand() * 4;

    float * alone = malloc(sizeof(float) * M * nmax);  /* each row through a 1-row product */
    for (int r = 0; r < nmax; r++) product(type, wq, K, M, x + (size_t) r * K, 1, threads, alone + (size_t) r * M);
    float * together = malloc(sizeof(float) * M * nmax);
    int bad = 0;
    /* and the products themselves: each single row against the dequantized weights times the row in
     * double precision, within what quantizing the activations (8 bits) can move a sum (a kernel
     * that sums fast and wrong, e.g. a block's offset dropped, is invariant too) */
    float * wd = malloc(sizeof(float) * K * M);
    ggml_get_type_traits(type)->to_float(wq, wd, (int64_t) K * M);
    for (int r = 0; r < nmax; r++) {
        for (int i = 0; i < M; i++) {
            double ref = 0, mag = 0;
            for (int c = 0; c < K; c++) {
                double t = (double) wd[(size_t) i * K + c] * x[(size_t) r * K + c];
                ref += t;
                mag += t < 0 ? -t : t;
            }
            double err = alone[(size_t) r * M + i] - ref;
            if ((err < 0 ? -err : err) > 0.02 * mag + 1e-6) {
                printf("%s, row %d output %d: %.9g, the float reference %.9g\n", argv[1], r, i, alone[(size_t) r * M + i], ref);
                bad = 1;
                r = nmax;
                break;
            }
        }
    }
    free(wd);
    for (int wi = 0; wi < N_WINDOWS; wi++) {
        int n = WINDOWS[wi];
        product(type, wq, K, M, x, n, threads, together);
        int differ = 0, first = -1;
        for (size_t i = 0; i < (size_t) M * n; i++) {
            if (memcmp(&alone[i], &together[i], 4) != 0) {
                if (first < 0) first = (int) i;
                differ++;
            }
        }
        if (differ) {
            printf("%s, %d rows: %d of %d outputs differ (row %d, output %d: %.9g alone, %.9g in the window)\n",
                   argv[1], n, differ, M * n, first / M, first % M, alone[first], together[first]);
            bad = 1;
        }
    }
    if (!bad) printf("ok: %s, windows of %d-%d rows equal single rows (K %d, M %d, %d threads)\n", argv[1], WINDOWS[0], nmax, K, M,
                     threads);
    return bad;
}
