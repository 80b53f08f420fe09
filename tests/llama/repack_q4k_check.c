/* patches/0005: the repacked q4_K kernels of an x86 build give a row the same bits alone (gemv: a
 * decoding step) and in a batch of 4+ rows (gemm: a verify window), and the 4-row activation
 * quantization equals the 1-row one.  Built and run by tests/llama/test_c_kernels.py against
 * the installed llama-cpp-python's libggml-cpu; prints what differs, exit status 1 if anything does.
 *
 *   repack_q4k_check SEED ROWS COLS TIES   (ROWS a multiple of 4, COLS of 8; TIES 1: rows holding
 *                                           both +max and -max in a block)
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef uint16_t ggml_half;
typedef struct { ggml_half d[8]; ggml_half dmin[8]; uint8_t scales[96]; uint8_t qs[1024]; } block_q4_Kx8;
typedef struct { float d[4]; int8_t qs[1024]; int16_t bsums[64]; } block_q8_Kx4;
typedef struct { float d; int8_t qs[256]; int16_t bsums[16]; } block_q8_K;

void ggml_gemv_q4_K_8x8_q8_K(int n, float * s, size_t bs, const void * vx, const void * vy, int nr, int nc);
void ggml_gemm_q4_K_8x8_q8_K(int n, float * s, size_t bs, const void * vx, const void * vy, int nr, int nc);
void ggml_quantize_mat_q8_K_4x8(const float * x, void * vy, int64_t k);
void quantize_row_q8_K(const float * x, void * y, int64_t k);
ggml_half ggml_fp32_to_fp16(float);
void ggml_cpu_init(void);

static double normal(void) {
    const double u = (rand() + 1.0) / (RAND_MAX + 2.0), v = (rand() + 1.0) / (RAND_MAX + 2.0);
    return sqrt(-2 * log(u)) * cos(6.283185307179586 * v);
}

int main(int argc, char ** argv) {
    if (argc != 5) {
        fprintf(stderr, "usage: %s SEED ROWS COLS TIES\n", argv[0]);
        return 2;
    }
    srand(atoi(argv[1]));
    const int nr = atoi(argv[2]), nc = atoi(argv[3]), ties = atoi(argv[4]);
    const int n = 4096, nb = n / 256;
    if (nr % 4 || nc % 8 || nr <= 0 || nc <= 0) {
        fprintf(stderr, "ROWS must be a multiple of 4, COLS of 8\n");
        return 2;
    }
    ggml_cpu_init();

    /* weights: any bytes are a valid interleaved q4_K block; small positive scales */
    block_q4_Kx8 * w = malloc(sizeof(block_q4_Kx8) * nb * (nc / 8));
    for (int i = 0; i < nb * (nc / 8); i++) {
        for (int c = 0; c < 8; c++) {
            w[i].d[c] = ggml_fp32_to_fp16(0.001f * (1 + rand() % 100));
            w[i].dmin[c] = ggml_fp32_to_fp16(0.001f * (1 + rand() % 100));
        }
        for (int j = 0; j < 96; j++) w[i].scales[j] = (uint8_t) rand();
        for (int j = 0; j < 1024; j++) w[i].qs[j] = (uint8_t) rand();
    }
    float * x = malloc(sizeof(float) * n * nr);
    for (int i = 0; i < n * nr; i++) x[i] = (float) normal();
    if (ties) {  /* +m and -m as a block's largest magnitudes, either one first */
        for (int r = 0; r < nr; r++) {
            for (int b = 0; b < nb; b += 3) {
                float * blk = x + (size_t) r * n + b * 256;
                const float m = 9.5f + b;
                blk[5 + b] = (r + b) % 2 ? m : -m;
                blk[100 + b] = (r + b) % 2 ? -m : m;
            }
        }
    }

    /* a lone row's activations (quantize_row_q8_K) and a batch's (4 rows at a time, interleaved) */
    block_q8_K * lone = malloc(sizeof(block_q8_K) * nb * nr);
    for (int r = 0; r < nr; r++) quantize_row_q8_K(x + (size_t) r * n, lone + r * nb, n);
    block_q8_Kx4 * batch = malloc(sizeof(block_q8_Kx4) * nb * (nr / 4));
    for (int g = 0; g < nr / 4; g++) ggml_quantize_mat_q8_K_4x8(x + (size_t) g * 4 * n, batch + g * nb, n);

    int bad = 0, quant_differ = 0;
    for (int r = 0; r < nr; r++) {
        for (int b = 0; b < nb; b++) {
            const block_q8_Kx4 * src = batch + (r / 4) * nb + b;
            const block_q8_K * ref = lone + r * nb + b;
            int differ = src->d[r % 4] != ref->d;
            for (int j = 0; j < 256; j++) {
                differ |= src->qs[(j / 8) * 32 + (r % 4) * 8 + j % 8] != ref->qs[j];
            }
            quant_differ += differ;
        }
    }
    if (quant_differ) {
        printf("quantize_mat_q8_K_4x8 vs quantize_row_q8_K: %d of %d blocks differ\n", quant_differ, nr * nb);
        bad = 1;
    }

    float * alone = malloc(sizeof(float) * nr * nc);
    float * together = malloc(sizeof(float) * nr * nc);
    for (int r = 0; r < nr; r++) ggml_gemv_q4_K_8x8_q8_K(n, alone + r * nc, nc, w, lone + r * nb, 1, nc);
    ggml_gemm_q4_K_8x8_q8_K(n, together, nc, w, batch, nr, nc);
    int out_differ = 0;
    double worst = 0;
    for (int i = 0; i < nr * nc; i++) {
        if (memcmp(&alone[i], &together[i], sizeof(float)) != 0) {
            out_differ++;
            worst = fmax(worst, fabs((double) alone[i] - together[i]));
        }
    }
    if (out_differ) {
        printf("gemv (one row) vs gemm (%d rows): %d of %d outputs differ, by up to %g\n", nr, out_differ, nr * nc, worst);
        bad = 1;
    }
    if (!bad) printf("ok: %d rows x %d columns bit for bit\n", nr, nc);
    return bad;
}
