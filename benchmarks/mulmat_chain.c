/* How fast one activation row goes through a chain of L float matrices (W x W) in ggml's mul_mat,
 * with the weights streamed from memory (DISTINCT 1: L different matrices) or hot in cache
 * (DISTINCT 0: one matrix L times): the diagnostic behind patches/0013 (BENCHMARKS.md, "One
 * float row's tiles").  Build it against the libraries to compare, e.g.
 *
 *   gcc -O2 -o chain_exact benchmarks/mulmat_chain.c -I.venv/lib/python3.11/site-packages/include \
 *       -L$LIB -Wl,-rpath,$LIB -lggml -lggml-cpu -lggml-base -lm
 *
 * with LIB the installed llama_cpp/lib (ours) or .cache/llama-bin (stock), then run both in turn:
 *
 *   chain_exact W L DISTINCT REPS [N [THREADS [TYPE [M]]]]     (576 1000 1 8: a narrow model)
 *
 * TYPE is any ggml type name (f16, bf16, q8_0, q4_1, q5_0, q4_K, ...; default f16).  With M (rows of
 * each matrix) other than W, the L products are independent (each M x W matrix times the same
 * activation rows) instead of a chain: e.g. 49152 rows of 576 is a narrow model's output matrix.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

#include "ggml.h"
#include "ggml-cpu.h"

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char ** argv) {
    if (argc < 5) {
        fprintf(stderr, "usage: %s W L DISTINCT REPS [N [THREADS [TYPE [M]]]]\n", argv[0]);
        return 2;
    }
    int W = atoi(argv[1]), L = atoi(argv[2]), distinct = atoi(argv[3]), reps = atoi(argv[4]);
    int N = argc > 5 ? atoi(argv[5]) : 1;
    int threads = argc > 6 ? atoi(argv[6]) : 2;
    enum ggml_type type = GGML_TYPE_COUNT;
    const char * tname = argc > 7 ? argv[7] : "f16";
    for (int t = 0; t < GGML_TYPE_COUNT; t++) {
        const char * name = ggml_type_name((enum ggml_type) t);
        if (name && strcasecmp(name, tname) == 0 && ggml_get_type_traits((enum ggml_type) t)->blck_size > 0) {
            type = (enum ggml_type) t;
        }
    }
    int M = argc > 8 ? atoi(argv[8]) : W;
    if (type == GGML_TYPE_COUNT) {
        fprintf(stderr, "unknown weight type %s\n", tname);
        return 2;
    }
    if (W < 32 || W % ggml_blck_size(type) != 0 || M < 1 || L < 1 || reps < 1 || N < 1 || threads < 1) {
        fprintf(stderr, "W >= 32 (a multiple of the type's block) and M, L, REPS, N, THREADS >= 1\n");
        return 2;
    }
    ggml_cpu_init();
    int n_mat = distinct ? L : 1;
    size_t mat_bytes = ggml_row_size(type, W) * M;
    struct ggml_init_params ip = {mat_bytes * n_mat + (size_t) L * ((size_t) (W > M ? W : M) * N * 4 + 1024) +
                                      64 * 1024 * 1024,
                                  NULL, false};
    struct ggml_context * ctx = ggml_init(ip);
    float * wf = malloc(sizeof(float) * W * M);
    srand(1);
    for (long i = 0; i < (long) W * M; i++) wf[i] = (rand() / (float) RAND_MAX - 0.5f) * 0.05f;
    struct ggml_tensor ** mats = malloc(sizeof(*mats) * n_mat);
    for (int l = 0; l < n_mat; l++) {
        mats[l] = ggml_new_tensor_2d(ctx, type, W, M);
        ggml_quantize_chunk(type, wf, mats[l]->data, 0, M, W, NULL);
    }
    struct ggml_tensor * x = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, W, N);
    for (int i = 0; i < W * N; i++) ((float *) x->data)[i] = rand() / (float) RAND_MAX - 0.5f;
    struct ggml_cgraph * gf = ggml_new_graph_custom(ctx, 4 * L + 16, false);
    struct ggml_tensor * y = x;
    for (int l = 0; l < L; l++) {
        /* a chain where the matrices are square, else independent products of the same rows */
        y = ggml_mul_mat(ctx, mats[distinct ? l : 0], M == W ? y : x);
        if (M != W) ggml_build_forward_expand(gf, y);
    }
    ggml_build_forward_expand(gf, y);
    struct ggml_cplan plan = ggml_graph_plan(gf, threads, NULL);
    plan.work_data = malloc(plan.work_size + 1);
    ggml_graph_compute(gf, &plan);  /* a warm-up pass */
    double best = 1e9, sum = 0;
    for (int r = 0; r < reps; r++) {
        double t0 = now();
        ggml_graph_compute(gf, &plan);
        double dt = now() - t0;
        sum += dt;
        best = dt < best ? dt : best;
    }
    printf("W %d M %d L %d distinct %d N %d threads %d %s: best %.3f ms, mean %.3f ms, per product best %.2f us\n", W, M, L,
           distinct, N, threads, ggml_type_name(type), best * 1e3, sum / reps * 1e3, best / L * 1e6);
    return 0;
}
