// mask_tiles.cuh: what a boolean mask shows of each tile of a kernel, classified before the kernel
// runs (mask_tiles.cu; cuflash/_mask_tiles.py launches it on every call, since a mask may change
// in place). A kernel skips the tiles its mask hides entirely and takes no per-element mask on the
// tiles it shows entirely (unless a bias still needs adding).
#pragma once

constexpr unsigned char TILE_HIDDEN = 0, TILE_VISIBLE = 1, TILE_MIXED = 2;

// One call's classes: per mask matrix (of output (batch b, head h): batch b * bmul, head h / hdiv,
// `heads` of them per batch; h = bh % H), query tile of the kernel's BLOCK_M rows (`qtiles`; 1 for a
// mask that is the same for every query row) and key chunk [c BLOCK_N, (c + 1) BLOCK_N) (`chunks`).
// cls null: no classes (every tile TILE_MIXED).
struct TileClasses {
  const unsigned char* cls;
  int qtiles, heads, chunks, hdiv, bmul, H;
};

// The chunk classes of output (batch, head) bh's query tile qt, or null without classes.
__device__ __forceinline__ const unsigned char* class_row(const TileClasses& c, long long bh,
                                                          int qt) {
  if (c.cls == nullptr) return nullptr;
  const long long b = bh / c.H, h = bh % c.H;
  const long long matrix = b * c.bmul * c.heads + h / c.hdiv;
  return c.cls + (matrix * c.qtiles + (c.qtiles > 1 ? qt : 0)) * c.chunks;
}

// The classes of chunk c in every query tile of bh: column[qt * step] (step 0 for a mask with
// one query tile), or null without classes.
struct ClassColumn {
  const unsigned char* column;
  int step;
};
__device__ __forceinline__ ClassColumn class_column(const TileClasses& c, long long bh, int chunk) {
  ClassColumn col;
  col.column = c.cls == nullptr ? nullptr : class_row(c, bh, 0) + chunk;
  col.step = c.qtiles > 1 ? c.chunks : 0;
  return col;
}

// The class of keys [j0, j0 + BLOCK_N) in such a row (j0 >= 0: at most two chunks).
template <int BLOCK_N>
__device__ __forceinline__ int tile_class(const unsigned char* row, int j0) {
  if (row == nullptr) return TILE_MIXED;
  const int first = row[j0 / BLOCK_N], last = row[(j0 + BLOCK_N - 1) / BLOCK_N];
  return first == last ? first : TILE_MIXED;
}

// The key tiles [j_first + it BLOCK_N, + BLOCK_N), it < n_tiles, of one query tile (class row
// `row`, from class_row), as a kernel with a mask visits them (ON; otherwise every tile counts as
// mixed and none is skipped): next(0), next(it + 1), ... skip the tiles the mask hides.
template <int BLOCK_N, bool ON>
struct TileWalk {
  const unsigned char* row;
  int j_first, n_tiles;
  __device__ __forceinline__ int cls(int it) const {
    return ON ? tile_class<BLOCK_N>(row, j_first + it * BLOCK_N) : int(TILE_MIXED);
  }
  __device__ __forceinline__ int next(int it) const {
    if (ON)
      while (it < n_tiles && cls(it) == TILE_HIDDEN) ++it;
    return it;
  }
};
