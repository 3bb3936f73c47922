// The K/V cache's 16-byte words, for the attention cores: KV_PER_WORD values a word (float16 with -DKV_F16, else
// float32), WORDS_PER_TOKEN words a token of HEAD_SIZE; PAIRS: the (row, 4 dimensions) slices of the ROWS query
// rows' output. The including file defines HEAD_SIZE and ROWS.
#ifdef KV_F16
#define KV_PER_WORD 8
#else
#define KV_PER_WORD 4
#endif
#define WORDS_PER_TOKEN (HEAD_SIZE / KV_PER_WORD)
#define PAIRS (ROWS * HEAD_SIZE / 4)
