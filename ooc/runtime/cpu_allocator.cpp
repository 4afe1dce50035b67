// A CPU allocator for PyTorch that recycles large blocks instead of handing them back to the
// kernel at every free. Built and loaded by ooc/runtime/cpu_allocator.py; see its docstring
// for why it exists. Blocks below kLarge go to PyTorch's own alloc_cpu/free_cpu unchanged.
//
// Large blocks are anonymous mmaps rounded up to kRound (2 MiB: whole transparent huge pages,
// and page-aligned so the swap file can use O_DIRECT on them). A freed large block goes to a
// cache keyed by its rounded size; when the cache would hold more than `cap` bytes, its oldest
// blocks are unmapped first. A request takes the most recently freed block of its size. The Python side raises `cap` while a step runs and drops it to 0 at the step's
// end, which unmaps everything cached: between steps the process holds only live bytes.
//
// One deleter serves every pointer this allocator returned (raw_deleter must: oneDNN frees
// through it), so it looks the pointer up: a large block it mapped, or a small one from
// alloc_cpu.

#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <c10/util/Exception.h>

#include <sys/mman.h>

#include <cerrno>
#include <cstring>
#include <list>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace {

constexpr size_t kLarge = size_t(1) << 20;
constexpr size_t kRound = size_t(2) << 20;

struct Counters {
  size_t cached = 0;       // bytes of freed blocks kept for reuse
  size_t mapped = 0;       // bytes of large blocks mapped (live + cached)
  size_t peak_mapped = 0;
  size_t hits = 0;         // large allocations served from the cache
  size_t misses = 0;       // large allocations that mapped fresh memory
  size_t cap = 0;          // most bytes the cache may hold
  int enabled = 0;         // 0: new allocations go to alloc_cpu (installed but idle)
};

struct Block {
  void* ptr;
  size_t size;
};
using Order = std::list<Block>;

std::mutex mu;
Counters c;
std::unordered_map<void*, size_t> live;                  // large block -> rounded size
Order order;                                             // cached blocks, oldest free first
std::unordered_map<size_t, std::vector<Order::iterator>> by_size;  // newest last

void unmap_locked(void* p, size_t n) {
  munmap(p, n);
  c.mapped -= n;
}

// Unmap cached blocks, oldest first, until at most `target` bytes stay cached. The newest
// frees are kept: a step allocates like a stack (what was just freed is asked for again
// soon), so the oldest block is the one least likely to be reused.
void shrink_locked(size_t target) {
  while (c.cached > target && !order.empty()) {
    Block b = order.front();
    auto& same = by_size[b.size];
    same.erase(same.begin());   // the oldest of its size is the list's oldest of that size
    order.pop_front();
    c.cached -= b.size;
    unmap_locked(b.ptr, b.size);
  }
}

void recycle_free(void* p) {
  if (p == nullptr) {
    return;
  }
  std::unique_lock<std::mutex> g(mu);
  auto it = live.find(p);
  if (it == live.end()) {
    g.unlock();
    c10::free_cpu(p);
    return;
  }
  size_t n = it->second;
  live.erase(it);
  if (!c.enabled || n > c.cap) {
    unmap_locked(p, n);
    return;
  }
  shrink_locked(c.cap - n);   // make room by dropping the oldest cached blocks
  by_size[n].push_back(order.insert(order.end(), Block{p, n}));
  c.cached += n;
}

void* take_large(size_t n) {
  size_t r = (n + kRound - 1) / kRound * kRound;
  {
    std::lock_guard<std::mutex> g(mu);
    auto it = by_size.find(r);
    if (it != by_size.end() && !it->second.empty()) {
      Order::iterator b = it->second.back();   // the most recently freed: warmest in cache
      void* p = b->ptr;
      it->second.pop_back();
      order.erase(b);
      c.cached -= r;
      c.hits++;
      live[p] = r;
      return p;
    }
    c.misses++;
  }
  void* p = mmap(nullptr, r, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    int err = errno;
    std::lock_guard<std::mutex> g(mu);
    shrink_locked(0);   // give the cache back and try once more
    p = mmap(nullptr, r, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    TORCH_CHECK(p != MAP_FAILED, "ooc CPU allocator: cannot map ", r, " bytes (", n,
                " requested): ", std::strerror(err));
  }
  madvise(p, r, MADV_HUGEPAGE);   // fewer page faults; harmless where THP is off
  std::lock_guard<std::mutex> g(mu);
  c.mapped += r;
  if (c.mapped > c.peak_mapped) {
    c.peak_mapped = c.mapped;
  }
  live[p] = r;
  return p;
}

struct RecyclingAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    bool large;
    {
      std::lock_guard<std::mutex> g(mu);
      large = c.enabled && n >= kLarge;
    }
    void* p = large ? take_large(n) : c10::alloc_cpu(n);
    return {p, p, &recycle_free, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &recycle_free; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

RecyclingAllocator instance;

}  // namespace

extern "C" {

// Make this PyTorch's CPU allocator; 1 if it now is (a higher-priority one may be set).
int ooc_cpu_allocator_install(int priority) {
  c10::SetCPUAllocator(&instance, static_cast<uint8_t>(priority));
  return c10::GetCPUAllocator() == &instance;
}

// Route large allocations here (enabled != 0) and let the cache hold up to cap bytes;
// shrinking the cap unmaps what no longer fits.
void ooc_cpu_allocator_configure(int enabled, size_t cap) {
  std::lock_guard<std::mutex> g(mu);
  c.enabled = enabled;
  c.cap = enabled ? cap : 0;
  shrink_locked(c.cap);
}

// cached, mapped, peak_mapped, hits, misses, cap, enabled
void ooc_cpu_allocator_stats(size_t* out) {
  std::lock_guard<std::mutex> g(mu);
  out[0] = c.cached;
  out[1] = c.mapped;
  out[2] = c.peak_mapped;
  out[3] = c.hits;
  out[4] = c.misses;
  out[5] = c.cap;
  out[6] = static_cast<size_t>(c.enabled);
}

}  // extern "C"
