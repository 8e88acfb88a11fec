// The CTA scheduler behind include/cuda_runtime.h, which states the model and its checks.
// Everything runs in the caller's OS thread, one CTA at a time; nothing here is thread-safe.

// A fiber starts on its own stack through makecontext and swapcontext, then switches with
// _setjmp and _longjmp, which skip swapcontext's signal-mask system call (the quantizer
// tests of test_cuda_emulated.py: 21 s with swapcontext, 9 s with these, warm, on 2 cores).
// Fortified longjmp refuses jumps between stacks.
#undef _FORTIFY_SOURCE

#include <cuda_runtime.h>
#include <setjmp.h>
#include <stdio.h>
#include <ucontext.h>

#include <algorithm>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

namespace emu {

uint3 thread_idx, block_idx;
dim3 block_dim, grid_dim;
uint64_t warp_lanes[32][32];

namespace {

constexpr size_t kStackBytes = 256 * 1024;
constexpr size_t kMaxStaticShared = 48 * 1024;
constexpr int kCtaBarrier = 0;  // barrier ids: the CTA's, then 1 + w for warp w

enum class State { kRunnable, kWaiting, kDone };

struct Fiber {
  ucontext_t start;  // its entry, until it first runs
  jmp_buf ctx;       // where it continues
  State state = State::kDone;
  int barrier = 0;
  bool started = false;
  std::unique_ptr<char[]> stack;
};

std::vector<Fiber> fibers;  // the open CTA's are fibers[0, threads); kept for the next CTA
int threads = 0;
jmp_buf scheduler;
int current = -1;  // the running fiber, -1 on the host
const std::function<void()>* cta_body = nullptr;
std::mt19937_64 rng;
int arrived[1 + 32];
const void* cta_site = nullptr;  // the __syncthreads call site of the open CTA barrier

const void* kernel = nullptr;
std::map<void*, size_t> shared_vars;           // every __shared__ variable: bytes
std::set<std::pair<const void*, void*>> seen;  // (kernel, variable) pairs counted below
std::map<const void*, size_t> static_shared;   // per kernel

cudaError_t last_error = cudaSuccess;
std::string failure;  // sticky until reset(): later launches do not run

void fill_garbage(void* p, size_t bytes) {
  auto* b = static_cast<unsigned char*>(p);
  for (size_t i = 0; i < bytes; i += 8) {
    const uint64_t r = rng();
    memcpy(b + i, &r, std::min<size_t>(8, bytes - i));
  }
}

// The running fiber gives the CPU back to the scheduler, to continue here later.
void yield() {
  if (_setjmp(fibers[current].ctx) == 0) _longjmp(scheduler, 1);
}

void fiber_main() {
  (*cta_body)();
  fibers[current].state = State::kDone;
  _longjmp(scheduler, 1);
}

// The calling fiber waits until `expected` threads have reached barrier `id`.
void wait_at(int id, int expected) {
  Fiber& f = fibers[current];
  f.state = State::kWaiting;
  f.barrier = id;
  if (++arrived[id] == expected) {
    arrived[id] = 0;
    if (id == kCtaBarrier) cta_site = nullptr;
    for (int i = 0; i < threads; ++i) {
      Fiber& g = fibers[i];
      if (g.state == State::kWaiting && g.barrier == id) g.state = State::kRunnable;
    }
  }
  yield();  // even the last to arrive yields: the order is drawn again
}

void start_fibers(int n) {
  // Stacks are allocated once (not zeroed: a fiber's locals start as garbage anyway) and
  // reused by later CTAs and launches, of any size.
  if ((int)fibers.size() < n) fibers.resize(n);
  threads = n;
  for (int i = 0; i < n; ++i) {
    Fiber& f = fibers[i];
    if (!f.stack) f.stack = std::make_unique_for_overwrite<char[]>(kStackBytes);
    getcontext(&f.start);
    f.start.uc_stack.ss_sp = f.stack.get();
    f.start.uc_stack.ss_size = kStackBytes;
    f.start.uc_link = nullptr;
    makecontext(&f.start, fiber_main, 0);
    f.started = false;
    f.state = State::kRunnable;
  }
  memset(arrived, 0, sizeof(arrived));
  cta_site = nullptr;
}

void run_cta() {
  const int n = (int)block_dim.x;
  for (auto& [p, bytes] : shared_vars) fill_garbage(p, bytes);
  start_fibers(n);
  std::vector<int> order(n);
  for (int i = 0; i < n; ++i) order[i] = i;
  for (bool done = false; !done;) {
    std::shuffle(order.begin(), order.end(), rng);
    bool ran = false;
    done = true;
    for (int i : order) {
      if (fibers[i].state == State::kRunnable) {
        ran = true;
        current = i;
        thread_idx = uint3((unsigned)i, 0, 0);
        if (_setjmp(scheduler) == 0) {  // the fiber comes back here: yield() or its end
          Fiber& f = fibers[i];
          if (f.started) _longjmp(f.ctx, 1);
          f.started = true;
          ucontext_t unused;
          swapcontext(&unused, &f.start);
        }
        current = -1;
        if (!failure.empty()) return;
        if (fibers[i].state == State::kDone && arrived[kCtaBarrier] > 0) {
          return fail("a thread exited while others wait at __syncthreads");
        }
        if (fibers[i].state == State::kDone && arrived[1 + i / 32] > 0) {
          return fail("a thread exited while others of its warp wait in a warp intrinsic");
        }
      }
      done = done && fibers[i].state == State::kDone;
    }
    if (!ran && !done) return fail("deadlock: every live thread waits at a barrier");
  }
}

}  // namespace

void fail(const char* what) {
  if (failure.empty()) {
    char where[96];
    if (current >= 0 || cta_body != nullptr) {
      snprintf(where, sizeof(where), "block (%u, %u, %u) thread %u: ", block_idx.x, block_idx.y,
               block_idx.z, thread_idx.x);
    } else {
      snprintf(where, sizeof(where), "launch: ");
    }
    failure = std::string(where) + what;
  }
  last_error = cudaErrorLaunchFailure;
  if (current >= 0) {  // leave the fiber for good; the scheduler sees the failure
    fibers[current].state = State::kDone;
    _longjmp(scheduler, 1);
  }
}

void cta_barrier(const void* site) {
  if (cta_site == nullptr) {
    cta_site = site;
  } else if (cta_site != site) {
    return fail("threads of one CTA wait at different __syncthreads");
  }
  wait_at(kCtaBarrier, threads);
}

void warp_barrier() { wait_at(1 + (int)(thread_idx.x >> 5), 32); }

void shared_declared(void* p, size_t bytes) {
  if (shared_vars.emplace(p, bytes).second) fill_garbage(p, bytes);
  if (seen.emplace(kernel, p).second && (static_shared[kernel] += bytes) > kMaxStaticShared) {
    fail("the kernel's static shared memory exceeds 48 KB");
  }
}

bool begin_launch(const void* k, dim3 grid, dim3 block, size_t dynamic_shared) {
  if (!failure.empty()) return false;
  const uint64_t threads = (uint64_t)block.x * block.y * block.z;
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.x > 0x7fffffffu || grid.y > 65535 ||
      grid.z > 65535 || threads == 0 || threads > 1024) {
    last_error = cudaErrorInvalidConfiguration;
    return false;
  }
  if (block.y != 1 || block.z != 1) {
    fail("only 1-D CTAs are emulated");
    return false;
  }
  if (dynamic_shared != 0) {
    fail("dynamic shared memory is not emulated");
    return false;
  }
  kernel = k;
  grid_dim = grid;
  block_dim = block;
  return true;
}

void run_grid(const std::function<void()>& cta) {
  cta_body = &cta;
  for (unsigned z = 0; z < grid_dim.z && failure.empty(); ++z) {
    for (unsigned y = 0; y < grid_dim.y && failure.empty(); ++y) {
      for (unsigned x = 0; x < grid_dim.x && failure.empty(); ++x) {
        block_idx = uint3(x, y, z);
        run_cta();
      }
    }
  }
  cta_body = nullptr;
}

cudaError_t take_error() {
  const cudaError_t e = last_error;
  if (failure.empty()) last_error = cudaSuccess;
  return e;
}

void reset(uint64_t seed) {
  rng.seed(seed);
  failure.clear();
  last_error = cudaSuccess;
}

const char* failure_message() { return failure.c_str(); }

}  // namespace emu
