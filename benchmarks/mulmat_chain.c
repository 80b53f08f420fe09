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
 *   chain_exact W L DISTINCT REPS [N [THREADS [f16|bf16]]]     (576 1000 1 8: a narrow model)
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
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
        fprintf(stderr, "usage: %s W L DISTINCT REPS [N [THREADS [f16|bf16]]]\n", argv[0]);
        return 2;
    }
    int W = atoi(argv[1]), L = atoi(argv[2]), distinct = atoi(argv[3]), reps = atoi(argv[4]);
    int N = argc > 5 ? atoi(argv[5]) : 1;
    int threads = argc > 6 ? atoi(argv[6]) : 2;
    enum ggml_type type = argc > 7 && strcmp(argv[7], "bf16") == 0 ? GGML_TYPE_BF16 : GGML_TYPE_F16;
    if (W < 32 || L < 1 || reps < 1 || N < 1 || threads < 1) {
        fprintf(stderr, "W >= 32 and L, REPS, N, THREADS >= 1\n");
        return 2;
    }
    ggml_cpu_init();
    int n_mat = distinct ? L : 1;
    size_t mat_bytes = ggml_row_size(type, W) * W;
    struct ggml_init_params ip = {mat_bytes * n_mat + (size_t) L * ((size_t) W * N * 4 + 1024) + 64 * 1024 * 1024,
                                  NULL, false};
    struct ggml_context * ctx = ggml_init(ip);
    float * wf = malloc(sizeof(float) * W * W);
    srand(1);
    for (int i = 0; i < W * W; i++) wf[i] = (rand() / (float) RAND_MAX - 0.5f) * 0.05f;
    struct ggml_tensor ** mats = malloc(sizeof(*mats) * n_mat);
    for (int l = 0; l < n_mat; l++) {
        mats[l] = ggml_new_tensor_2d(ctx, type, W, W);
        ggml_quantize_chunk(type, wf, mats[l]->data, 0, W, W, NULL);
    }
    struct ggml_tensor * x = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, W, N);
    for (int i = 0; i < W * N; i++) ((float *) x->data)[i] = rand() / (float) RAND_MAX - 0.5f;
    struct ggml_tensor * y = x;
    for (int l = 0; l < L; l++) y = ggml_mul_mat(ctx, mats[distinct ? l : 0], y);
    struct ggml_cgraph * gf = ggml_new_graph_custom(ctx, 4 * L + 16, false);
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
    printf("W %d L %d distinct %d N %d threads %d %s: best %.3f ms, mean %.3f ms, per product best %.2f us\n", W, L,
           distinct, N, threads, ggml_type_name(type), best * 1e3, sum / reps * 1e3, best / L * 1e6);
    return 0;
}
