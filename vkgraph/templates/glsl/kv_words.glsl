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
// Pair i of those slices: its row and its slice of 4 dimensions. -DROW_LANES (the tiles core) interleaves the rows
// (row i % ROWS, slice i / ROWS), so that a subgroup's lanes hold every row of fewer dimensions and read each value
// word of a token once for all of them, where one row a subgroup reads a token's every word for each row.
// PAIR_AT(i): the pair's place in row-major order (row, then slice).
#ifdef ROW_LANES
#define PAIR_ROW(i) ((i) % ROWS)
#define PAIR_QUAD(i) ((i) / ROWS)
#define PAIR_AT(i) (PAIR_ROW(i) * (HEAD_SIZE / 4) + PAIR_QUAD(i))
#else
#define PAIR_ROW(i) ((i) / (HEAD_SIZE / 4))
#define PAIR_QUAD(i) ((i) % (HEAD_SIZE / 4))
#define PAIR_AT(i) (i)
#endif
