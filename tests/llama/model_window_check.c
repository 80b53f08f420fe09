/* A whole model's verify windows against plain decoding, through libllama alone (what
 * mars_local.llama.invariance.model_invariance checks from Python, for a machine without our
 * Python: an aarch64 cross-build run under qemu-user, scripts/arm_window_check.sh).
 *
 * Loads MODEL as mars-local loads an exact target (no weight repacking), decodes N tokens plainly
 * (greedy, one row per forward), then evaluates the same tokens again in windows of each size
 * (the cache rolled back to the prompt) and compares every row's logits bit for bit.
 *
 *   model_window_check MODEL [THREADS [N]]      prints what differs; exit status 1 if anything does
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "llama.h"

static const int WINDOWS[] = {2, 4, 5, 8, 9, 16, 17};

static void quiet(enum ggml_log_level level, const char * text, void * data) {
    (void) data;
    if (level == GGML_LOG_LEVEL_ERROR) fputs(text, stderr);
}

/* rows of logits for tokens[0..n) at positions pos.., all rows output */
static const float * eval(struct llama_context * ctx, const llama_token * tokens, int n, int pos) {
    struct llama_batch b = llama_batch_init(n, 0, 1);
    for (int i = 0; i < n; i++) {
        b.token[i] = tokens[i];
        b.pos[i] = pos + i;
        b.n_seq_id[i] = 1;
        b.seq_id[i][0] = 0;
        b.logits[i] = 1;
    }
    b.n_tokens = n;
    if (llama_decode(ctx, b) != 0) {
        fprintf(stderr, "llama_decode failed\n");
        exit(2);
    }
    llama_batch_free(b);
    return llama_get_logits(ctx);
}

int main(int argc, char ** argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s MODEL [THREADS [N]]\n", argv[0]);
        return 2;
    }
    int threads = argc > 2 ? atoi(argv[2]) : 2;
    int n = argc > 3 ? atoi(argv[3]) : 34;
    llama_log_set(quiet, NULL);
    llama_backend_init();
    struct llama_model_params mp = llama_model_default_params();
    mp.use_extra_bufts = false;  /* no repacking: mars-local's exact target */
    mp.n_gpu_layers = 0;         /* the CPU's kernels (a GPU build's own bound is 16 rows: README) */
    struct llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) {
        fprintf(stderr, "cannot load %s\n", argv[1]);
        return 2;
    }
    const struct llama_vocab * vocab = llama_model_get_vocab(model);
    int n_vocab = llama_vocab_n_tokens(vocab);
    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = 256;
    cp.n_batch = cp.n_ubatch = 256;
    cp.n_threads = cp.n_threads_batch = threads;
    struct llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) {
        fprintf(stderr, "cannot create a context\n");
        return 2;
    }
    llama_memory_t mem = llama_get_memory(ctx);

    llama_token prompt[8];
    for (int i = 0; i < 8; i++) prompt[i] = (llama_token) ((i * 37 + 11) % n_vocab);
    eval(ctx, prompt, 7, 0);
    const int base = 7;
    llama_token * seq = malloc(sizeof(llama_token) * (n + 1));
    float * plain = malloc(sizeof(float) * (size_t) n * n_vocab);
    seq[0] = prompt[7];
    for (int i = 0; i < n; i++) {  /* plain greedy decoding: one row per forward */
        const float * row = eval(ctx, &seq[i], 1, base + i);
        memcpy(plain + (size_t) i * n_vocab, row, sizeof(float) * n_vocab);
        int best = 0;
        for (int v = 1; v < n_vocab; v++) if (row[v] > row[best]) best = v;
        seq[i + 1] = best;
    }
    int bad = 0;
    for (size_t wi = 0; wi < sizeof WINDOWS / sizeof WINDOWS[0]; wi++) {
        int w = WINDOWS[wi], differ = 0, rows = 0;
        llama_memory_seq_rm(mem, 0, base, -1);
        for (int s = 0; s + w <= n; s += w) {
            const float * got = eval(ctx, &seq[s], w, base + s);
            for (int i = 0; i < w; i++, rows++) {
                if (memcmp(got + (size_t) i * n_vocab, plain + (size_t) (s + i) * n_vocab, sizeof(float) * n_vocab) != 0) differ++;
            }
        }
        if (differ) {
            printf("window %d: %d of %d rows differ from 1-row decoding\n", w, differ, rows);
            bad = 1;
        }
    }
    if (!bad) printf("ok: windows of 2-17 rows equal 1-row decoding (%d tokens, %d threads)\n", n, threads);
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return bad;
}
