// memfit's replay allocator: serves a training step's allocations from a static plan's arena.
//
// The CUDAPluggableAllocator ABI (torch.cuda.memory.CUDAPluggableAllocator):
//   void* memfit_replay_malloc(ssize_t size, int device, cudaStream_t stream);
//   void  memfit_replay_free(void* ptr, size_t size, int device, cudaStream_t stream);
// plus the controls memfit.memplan.replay_allocator calls through ctypes.
//
// The matching is memfit/memplan/replay_match.py's ReplayMatcher, line for line (that Python
// class is the tested spec; tests/memplan/test_replay_alloc_core.py compiles this file with
// -DMEMFIT_REPLAY_HOST and holds its counts to the Python ones on a real step's sequence):
//   - not armed, or 0 bytes: the fallback serves it, uncounted;
//   - the k-th malloc since begin_step is the plan's k-th born storage: rounded up to `align`,
//     the same size and its block not overlapping a live hit -> arena + offset (a hit); else a
//     miss (other size) or a conflict (block still held), served by the fallback;
//   - past the plan's last storage: beyond_plan, served by the fallback.
// The fallback is cudaMalloc / cudaFree (host malloc / free with MEMFIT_REPLAY_HOST). A free
// inside the arena releases the hit's block; any other pointer goes to the fallback.
// One arena per process, on one device, one stream: the plan is a single-stream step's.

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <unordered_map>
#include <vector>

#ifdef MEMFIT_REPLAY_HOST
typedef void* memfit_stream_t;
#else
#include <cuda_runtime_api.h>
typedef cudaStream_t memfit_stream_t;
#endif

namespace {

struct Planned {
  int64_t size;
  int64_t offset;
};

struct State {
  std::mutex mu;
  std::vector<Planned> expected;
  std::unordered_map<int64_t, int64_t> live;  // hits: offset -> size
  char* arena = nullptr;
  int64_t arena_bytes = 0;
  int64_t align = 1;
  int device = -1;
  bool armed = false;
  size_t cursor = 0;
  int64_t hits = 0, misses = 0, conflicts = 0, beyond_plan = 0;
};

State& state() {
  static State s;
  return s;
}

void* fallback_malloc(size_t size, int device) {
#ifdef MEMFIT_REPLAY_HOST
  (void)device;
  return std::malloc(size ? size : 1);
#else
  int current = -1;
  cudaGetDevice(&current);
  if (current != device) cudaSetDevice(device);
  void* ptr = nullptr;
  cudaError_t err = cudaMalloc(&ptr, size);
  if (current != device) cudaSetDevice(current);
  return err == cudaSuccess ? ptr : nullptr;
#endif
}

void fallback_free(void* ptr, int device) {
#ifdef MEMFIT_REPLAY_HOST
  (void)device;
  std::free(ptr);
#else
  int current = -1;
  cudaGetDevice(&current);
  if (current != device) cudaSetDevice(device);
  cudaFree(ptr);
  if (current != device) cudaSetDevice(current);
#endif
}

bool overlaps_live(const State& s, int64_t offset, int64_t size) {
  for (const auto& kv : s.live) {
    if (offset < kv.first + kv.second && kv.first < offset + size) return true;
  }
  return false;
}

}  // namespace

extern "C" {

// Load a plan: n storages in birth order (sizes already rounded to `align`), the arena's
// bytes, on `device`. Returns 0, 1 if the arena cannot be allocated, 2 if hits are still live.
int memfit_replay_set_plan(const int64_t* sizes, const int64_t* offsets, int64_t n,
                           int64_t arena_bytes, int64_t align, int device) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  if (!s.live.empty()) return 2;
  if (s.arena != nullptr) fallback_free(s.arena, s.device);
  s.arena = nullptr;
  s.expected.clear();
  for (int64_t i = 0; i < n; ++i) s.expected.push_back({sizes[i], offsets[i]});
  s.arena_bytes = arena_bytes;
  s.align = align > 0 ? align : 1;
  s.device = device;
  s.cursor = 0;
  s.hits = s.misses = s.conflicts = s.beyond_plan = 0;
  if (arena_bytes > 0) {
    s.arena = static_cast<char*>(fallback_malloc(static_cast<size_t>(arena_bytes), device));
    if (s.arena == nullptr) return 1;
  }
  s.armed = true;
  return 0;
}

void memfit_replay_begin_step() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  s.cursor = 0;
}

void memfit_replay_arm(int armed) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  s.armed = armed != 0 && !s.expected.empty();
}

// hits, misses, conflicts, beyond_plan, live hits, arena bytes
void memfit_replay_stats(int64_t* out) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  out[0] = s.hits;
  out[1] = s.misses;
  out[2] = s.conflicts;
  out[3] = s.beyond_plan;
  out[4] = static_cast<int64_t>(s.live.size());
  out[5] = s.arena_bytes;
}

void* memfit_replay_malloc(ptrdiff_t size, int device, memfit_stream_t stream) {
  (void)stream;
  State& s = state();
  {
    std::lock_guard<std::mutex> lock(s.mu);
    if (s.armed && size > 0 && device == s.device) {
      const int64_t rounded = (static_cast<int64_t>(size) + s.align - 1) / s.align * s.align;
      if (s.cursor >= s.expected.size()) {
        s.beyond_plan += 1;
      } else {
        const Planned want = s.expected[s.cursor];
        s.cursor += 1;
        if (rounded != want.size) {
          s.misses += 1;
        } else if (overlaps_live(s, want.offset, rounded)) {
          s.conflicts += 1;
        } else {
          s.live[want.offset] = rounded;
          s.hits += 1;
          return s.arena + want.offset;
        }
      }
    }
  }
  return fallback_malloc(static_cast<size_t>(size), device);
}

void memfit_replay_free(void* ptr, size_t size, int device, memfit_stream_t stream) {
  (void)size;
  (void)stream;
  State& s = state();
  {
    std::lock_guard<std::mutex> lock(s.mu);
    char* p = static_cast<char*>(ptr);
    if (s.arena != nullptr && p >= s.arena && p < s.arena + s.arena_bytes) {
      s.live.erase(static_cast<int64_t>(p - s.arena));
      return;
    }
  }
  fallback_free(ptr, device);
}

}  // extern "C"
