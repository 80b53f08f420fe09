/* patches/0006: ggml_vec_dot_q6_K_q8_K_cols (one q6_K weight row against 1-8 activation columns,
 * a verify window's rows) gives each column bit for bit what ggml_vec_dot_q6_K_q8_K (a decoding
 * step's kernel) gives it alone.  Built and run by tests/llama/test_c_kernels.py against the
 * installed llama-cpp-python's libggml-cpu; prints what differs, exit status 1 if anything does.
 *
 *   q6k_cols_check SEED
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef uint16_t ggml_half;
typedef struct { uint8_t ql[128]; uint8_t qh[64]; int8_t scales[16]; ggml_half d; } block_q6_K;
typedef struct { float d; int8_t qs[256]; int16_t bsums[16]; } block_q8_K;

void ggml_vec_dot_q6_K_q8_K(int n, float * s, size_t bs, const void * vx, size_t bx, const void * vy, size_t by, int nrc);
void ggml_vec_dot_q6_K_q8_K_cols(int n, float * s, size_t bs, const void * vx, const void * vy, size_t by, int nc);
void quantize_row_q8_K(const float * x, void * y, int64_t k);
ggml_half ggml_fp32_to_fp16(float);
void ggml_cpu_init(void);

int main(int argc, char ** argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s SEED\n", argv[0]);
        return 2;
    }
    ggml_cpu_init();
    srand(atoi(argv[1]));
    const int n = 4096, nb = n / 256;
    block_q6_K * w = malloc(sizeof(block_q6_K) * nb);
    for (int i = 0; i < nb; i++) {  /* any bytes are valid quants; signed 6-bit-range scales */
        for (int j = 0; j < 128; j++) w[i].ql[j] = (uint8_t) rand();
        for (int j = 0; j < 64; j++) w[i].qh[j] = (uint8_t) rand();
        for (int j = 0; j < 16; j++) w[i].scales[j] = (int8_t) (rand() % 127 - 63);
        w[i].d = ggml_fp32_to_fp16(0.0005f * (1 + rand() % 50));
    }
    float * x = malloc(sizeof(float) * n * 8);
    for (int i = 0; i < n * 8; i++) x[i] = (rand() / (float) RAND_MAX - 0.5f) * 4;
    block_q8_K * q = malloc(sizeof(block_q8_K) * nb * 8);
    for (int c = 0; c < 8; c++) quantize_row_q8_K(x + (size_t) c * n, q + c * nb, n);

    int bad = 0;
    for (int nc = 1; nc <= 8; nc++) {
        float alone[8], together[8];
        for (int c = 0; c < nc; c++) ggml_vec_dot_q6_K_q8_K(n, &alone[c], 0, w, 0, q + c * nb, 0, 1);
        ggml_vec_dot_q6_K_q8_K_cols(n, together, 1, w, q, sizeof(block_q8_K) * nb, nc);
        for (int c = 0; c < nc; c++) {
            if (memcmp(&alone[c], &together[c], sizeof(float)) != 0) {
                printf("%d columns: column %d %.9g alone, %.9g in the window\n", nc, c, alone[c], together[c]);
                bad = 1;
            }
        }
    }
    if (!bad) printf("ok: 1-8 columns bit for bit\n");
    return bad;
}
