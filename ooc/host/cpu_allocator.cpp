// A CPU allocator for PyTorch that recycles large blocks instead of handing them back to the
// kernel at every free. Built and loaded by ooc/host/cpu_allocator.py; see its docstring
// for why it exists. Blocks below kLarge go to PyTorch's own alloc_cpu/free_cpu unchanged.
//
// Large blocks are anonymous mmaps rounded up to kRound (2 MiB: whole transparent huge pages),
// or to a page in a step with a cap (see map_aligned); page-aligned, so the swap file can use
// O_DIRECT on them.
// While enabled (an engine step runs), a freed large block is kept, merged with cached
// neighbours in the address space, and a request takes the smallest cached block that holds
// it (best fit), splitting off the rest.
// A request that no cached block holds (a miss) gathers the pages of smaller ones, largest
// first, into one new range (mremap moves page tables, not bytes) and maps fresh only what the
// cache cannot give: the kernel zeroes every fresh page, at about 1 GB/s on this project's VM.
// Keeping a freed block maps nothing new, so the cache only has to shrink when fresh memory
// must be mapped, or when ooc's device pool (memory beside this allocator, reported with
// ooc_cpu_allocator_external) grows.
//
// The pool's chunks are anonymous pages too (vmm/anon_host.py), and they share this cache:
// a new chunk takes its pages from it (ooc_cpu_allocator_lend: best fit, as a request would)
// and a released chunk gives them to it (ooc_cpu_allocator_adopt). So a swap-in lands on
// pages a freed activation left, and a tensor on pages a swapped-in one left: no page is
// zeroed by the kernel because it changed sides.
//
// Idle memory is the cache plus the pool's idle chunks (they exist but hold no tensor; the
// engine releases them as it frees ranges, so there are few); it may fill what separates the
// live bytes (live blocks + the pool's used bytes) from their peak in this step or the one
// before, or `floor`, whichever is more. When idle memory is over that, the oldest cached
// blocks are unmapped first. Idle memory therefore never lifts the process above a peak its
// live tensors already reached (by more than one op's allocations). Under a budget for the
// whole step it also never exceeds `cap`, the cache's share of that budget, but where live and
// idle bytes together stay within `total` (the budget less what glibc's tensors hold at most):
// the live peak here is of this allocator's blocks only, and glibc's tensors peak at other times.
//
// Between steps (disabled) nothing new is cached: a large request is served from the cache
// (a block that fits, else gathered) while it holds anything, else by alloc_cpu; a freed
// block is unmapped (a chunk the pool releases is still
// adopted: the pool only releases chunks the next step would take again). So the next step
// finds its blocks still populated (no page faults, no zeroing), and memory used between
// steps (evaluation) replaces the cache instead of adding to it. release() unmaps the whole
// cache.
//
// A storage keeps the allocator it was made with, so parameters built before this one was
// installed would go on resizing through glibc at every swap-in; the engine claims them
// (ooc_cpu_allocator_claim).
//
// One deleter serves every pointer this allocator returned (raw_deleter must: oneDNN frees
// through it), so it looks the pointer up: a large block it mapped, or a small one from
// alloc_cpu.

#include <c10/core/CPUAllocator.h>
#include <c10/core/StorageImpl.h>
#include <c10/core/impl/alloc_cpu.h>
#include <c10/util/Exception.h>

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <unordered_map>
#include <utility>

namespace {

constexpr size_t kLarge = size_t(1) << 20;
constexpr size_t kRound = size_t(2) << 20;
const size_t kPage = static_cast<size_t>(sysconf(_SC_PAGESIZE));

struct Counters {
  size_t cached = 0;       // bytes of freed blocks kept for reuse
  size_t mapped = 0;       // bytes of large blocks mapped (live + cached)
  size_t peak_mapped = 0;
  size_t hits = 0;         // large allocations served from the cache
  size_t misses = 0;       // large allocations that mapped fresh memory
  size_t fresh = 0;        // bytes mapped fresh (the kernel zeroes them at first touch)
  size_t gathered = 0;     // bytes a miss took from smaller cached blocks instead (mremap)
  size_t floor = 0;        // bytes the cache may hold even above the live peak
  size_t cap = SIZE_MAX;   // bytes idle memory never exceeds (a budget for the whole step)...
  size_t total = SIZE_MAX; // ...unless live and idle together stay within this (idle_cap_locked)
  int enabled = 0;         // 0: new allocations go to alloc_cpu (installed but idle)
  int huge = 1;            // map blocks as transparent huge pages (0: the last step had a cap)
  size_t external = 0;     // bytes the device pool (beside this allocator) holds tensors in
  size_t idle_external = 0;  // bytes of the pool's chunks that hold no tensor
  size_t peak_live = 0;    // most bytes live at once (large blocks + external), ever
  size_t step_peak = 0;    // the same, in the step that runs (or ran last)
  size_t last_peak = 0;    // the same, in the step before it
};

using Addr = char*;
struct Free {
  size_t size;
  uint64_t age;            // when it was freed: the oldest go first
};

// Made once and never destroyed: tensors that C++ statics hold are freed through
// recycle_free while the process exits, after this library's own statics would be gone.
std::mutex& mu = *new std::mutex;
Counters c;
uint64_t clock_ = 0;
auto& live = *new std::unordered_map<void*, size_t>;          // large block -> rounded size
auto& by_addr = *new std::map<Addr, Free>;                    // cached, for merging neighbours
auto& by_size = *new std::set<std::pair<size_t, Addr>>;       // for best fit
auto& by_age = *new std::set<std::pair<uint64_t, Addr>>;      // for dropping the oldest

// What the process holds for tensors besides the cache: live large blocks and the pool.
size_t live_bytes() { return c.mapped - c.cached + c.external; }

void keep_locked(Addr p, size_t n, uint64_t age) {
  by_addr.emplace(p, Free{n, age});
  by_size.emplace(n, p);
  by_age.emplace(age, p);
  c.cached += n;
}

Free forget_locked(std::map<Addr, Free>::iterator it) {
  Free f = it->second;
  by_size.erase({f.size, it->first});
  by_age.erase({f.age, it->first});
  by_addr.erase(it);
  c.cached -= f.size;
  return f;
}

// Unmap cached blocks, oldest first, until at most `target` bytes stay cached. A step
// allocates like a stack (what was just freed is asked for again soon), so the oldest block
// is the one least likely to be reused.
void shrink_locked(size_t target) {
  while (c.cached > target && !by_age.empty()) {
    Addr p = by_age.begin()->second;
    Free f = forget_locked(by_addr.find(p));
    munmap(p, f.size);
    c.mapped -= f.size;
  }
}

void note_live_locked() {
  size_t now = live_bytes();
  c.peak_live = std::max(c.peak_live, now);
  c.step_peak = std::max(c.step_peak, now);
}

// The most idle memory may hold beside `live` bytes: `cap`, or, where a budget for the whole
// step left room for this allocator's live and idle bytes together (`total`: the budget less
// glibc's tensors' most in the step and the cache's share), more while the live bytes leave
// it. A cap alone unmapped what the backward freed and the next forward mapped again:
// ResNet-18 b32's steps faulted 1.6 GiB of fresh pages each, 1.43 s where uncapped 1.15.
size_t idle_cap_locked(size_t live) {
  if (c.total == SIZE_MAX) {
    return c.cap;
  }
  return std::max(c.cap, c.total > live ? c.total - live : 0);
}

// Bring idle memory within its bound with `extra` bytes about to be mapped: the bound keeps
// everything mapped within the live peak of this step or the one before (steps repeat; an
// older, larger peak such as the recording step's is no excuse), or `floor`, whichever is
// more. Only the cache shrinks (the pool's idle chunks are few and short-lived: the engine
// releases them into the cache).
void bound_idle_locked(size_t extra) {
  size_t want = live_bytes() + extra;
  size_t peak = std::max(c.step_peak, c.last_peak);
  size_t idle = std::min(std::max(c.floor, peak > want ? peak - want : 0), idle_cap_locked(want));
  size_t for_cache = idle > c.idle_external ? idle - c.idle_external : 0;
  shrink_locked(for_cache);
}

// Keep n freed bytes at p, merged with cached neighbours (larger blocks fit more).
void cache_locked(Addr p, size_t n) {
  auto next = by_addr.find(p + n);
  if (next != by_addr.end()) {
    n += forget_locked(next).size;
  }
  auto prev = by_addr.lower_bound(p);
  if (prev != by_addr.begin() && (--prev)->first + prev->second.size == p) {
    p = prev->first;
    n += forget_locked(prev).size;
  }
  keep_locked(p, n, ++clock_);
}

void recycle_free(void* ptr) {
  if (ptr == nullptr) {
    return;
  }
  std::unique_lock<std::mutex> g(mu);
  auto it = live.find(ptr);
  if (it == live.end()) {
    g.unlock();
    c10::free_cpu(ptr);
    return;
  }
  Addr p = static_cast<Addr>(ptr);
  size_t n = it->second;
  live.erase(it);
  if (!c.enabled) {
    munmap(p, n);
    c.mapped -= n;
    return;
  }
  cache_locked(p, n);
  size_t cap = idle_cap_locked(live_bytes());
  if (c.cached + c.idle_external > cap) {   // (uncapped, the bound waits for a mapping)
    shrink_locked(cap > c.idle_external ? cap - c.idle_external : 0);
  }
}

// What a block's size is a multiple of: a huge page, or a page where blocks are not huge.
size_t multiple() { return c.huge ? kRound : kPage; }

size_t rounded(size_t n) { return (n + multiple() - 1) / multiple() * multiple(); }

// The smallest cached block that holds r bytes, split to size; nullptr if none does.
void* from_cache_locked(size_t r) {
  auto fit = by_size.lower_bound({r, nullptr});
  if (fit == by_size.end()) {
    return nullptr;
  }
  Addr p = fit->second;
  Free f = forget_locked(by_addr.find(p));
  if (f.size > r) {
    keep_locked(p + r, f.size - r, f.age);   // the rest stays cached, as old as it was
  }
  c.hits++;
  live[p] = r;
  note_live_locked();
  return p;
}

// Fresh anonymous memory for r bytes, starting on a huge-page boundary (so pages moved in
// whole huge pages stay huge); nullptr if the kernel refuses. Kernels from 6.7 align such
// mappings themselves, and then blocks mapped one after another are neighbours, which the
// cache merges; elsewhere a mapping one huge page longer is trimmed to the boundary.
//
// Huge pages fault fewer times, but a block is resident whole once touched, and a block
// rounded to them holds up to 2 MiB more than its tensor. Under a budget for the whole step
// (a cap) that rounding was memory the budget did not count for managed tensors: a 2-layer
// Llama at the 58 MiB step budget its loop named peaked at 76-78 MiB with huge pages, 59-63
// without, and 52-56 (at 56 MiB named) with blocks rounded to a page. So there, no huge pages.
Addr map_aligned(size_t r) {
  void* v = mmap(nullptr, r, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (v == MAP_FAILED) {
    return nullptr;
  }
  Addr p = static_cast<Addr>(v);
  if (!c.huge) {
    madvise(p, r, MADV_NOHUGEPAGE);   // (where THP is "always", the kernel would use them)
    return p;
  }
  if (reinterpret_cast<uintptr_t>(p) % kRound != 0) {
    munmap(p, r);
    v = mmap(nullptr, r + kRound, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (v == MAP_FAILED) {
      return nullptr;
    }
    Addr base = static_cast<Addr>(v);
    p = reinterpret_cast<Addr>((reinterpret_cast<uintptr_t>(base) + kRound - 1) / kRound * kRound);
    if (p > base) {
      munmap(base, p - base);
    }
    munmap(p + r, base + r + kRound - (p + r));
  }
  madvise(p, r, MADV_HUGEPAGE);   // fewer page faults; harmless where THP is off
  return p;
}

// A miss: r bytes that no cached block holds. Rather than unmap cached blocks and let the
// kernel zero fresh pages (about 1 GB/s on this project's VM: VGG16 at 1/2 of its peak spent
// ~0.06 s a step in the compute threads' page faults), the cached blocks' pages are moved,
// largest first, into one new range (mremap moves page tables, not bytes); only what the
// cache cannot give is fresh. A block that spans two kernel mappings cannot move whole: it
// moves in pieces of the blocks' multiple (a huge page, or a page), and a piece that still
// cannot move stays cached. The caller holds mu; the returned block is live.
Addr gather_locked(size_t r) {
  Addr dst = map_aligned(r);
  if (dst == nullptr) {
    return nullptr;
  }
  size_t off = 0;
  while (off < r && !by_size.empty()) {
    Addr p = by_size.rbegin()->second;
    Free f = forget_locked(by_addr.find(p));
    size_t take = std::min(f.size, r - off);
    size_t moved = 0;
    for (size_t piece = take; moved < take;) {
      piece = std::min(piece, take - moved);
      void* got = mremap(p + moved, piece, piece, MREMAP_MAYMOVE | MREMAP_FIXED, dst + off + moved);
      if (got != MAP_FAILED) {
        moved += piece;
      } else if (piece > multiple()) {
        piece = std::max(multiple(), piece / 2 / multiple() * multiple());
      } else {
        break;
      }
    }
    if (moved < f.size) {   // the rest stays cached, as old as it was
      keep_locked(p + moved, f.size - moved, f.age);
    }
    off += moved;
    if (moved < take) {
      break;
    }
  }
  c.gathered += off;
  c.mapped += r - off;   // the moved pages were counted as cached ones
  c.fresh += r - off;
  return dst;
}

// A large block of at least n bytes: a cached block that holds it, else one gathered from
// smaller ones (fresh pages only for what the cache cannot give). Between steps (disabled)
// the caller asks only while something is cached: the cache is used up, never filled.
void* take_large_locked(size_t n) {
  size_t r = rounded(n);
  if (void* p = from_cache_locked(r)) {
    return p;
  }
  c.misses++;
  Addr p = gather_locked(r);
  if (p == nullptr) {
    shrink_locked(0);   // give the cache back and try once more
    p = map_aligned(r);
    TORCH_CHECK(p != nullptr, "ooc CPU allocator: cannot map ", r, " bytes (", n,
                " requested): ", std::strerror(errno));
    c.mapped += r;
    c.fresh += r;
  }
  c.peak_mapped = std::max(c.peak_mapped, c.mapped);
  live[p] = r;
  note_live_locked();
  bound_idle_locked(0);
  return p;
}

struct RecyclingAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    void* p = nullptr;
    if (n >= kLarge) {
      std::lock_guard<std::mutex> g(mu);
      if (c.enabled || c.cached > 0) {
        p = take_large_locked(n);
      }
    }
    if (p == nullptr) {
      p = c10::alloc_cpu(n);
    }
    return {p, p, &recycle_free, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &recycle_free; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

RecyclingAllocator instance;
c10::Allocator* previous = nullptr;   // PyTorch's CPU allocator before install

}  // namespace

extern "C" {

// Make this PyTorch's CPU allocator; 1 if it now is (a higher-priority one may be set).
// The one it replaces is kept for ooc_cpu_allocator_uninstall.
int ooc_cpu_allocator_install(int priority) {
  c10::Allocator* now = c10::GetCPUAllocator();
  if (now != &instance) {
    previous = now;
  }
  c10::SetCPUAllocator(&instance, static_cast<uint8_t>(priority));
  return c10::GetCPUAllocator() == &instance;
}

// Give PyTorch back the allocator install replaced; 1 if it is back. Blocks this allocator
// handed out stay valid: their deleter is this library's, which is never unloaded.
int ooc_cpu_allocator_uninstall(int priority) {
  if (c10::GetCPUAllocator() != &instance || previous == nullptr) {
    return 0;
  }
  c10::SetCPUAllocator(previous, static_cast<uint8_t>(priority));
  return c10::GetCPUAllocator() == previous;
}

// 1 if PyTorch's CPU allocator is this one now.
int ooc_cpu_allocator_is_installed() { return c10::GetCPUAllocator() == &instance; }

// Route large allocations here and cache freed ones (enabled != 0), the cache holding at
// least `floor` bytes when it must shrink. Disabling keeps the cache for the next step.
void ooc_cpu_allocator_configure(int enabled, size_t floor, size_t cap, size_t total) {
  std::lock_guard<std::mutex> g(mu);
  if (enabled && !c.enabled) {   // a step starts: the one before it sets the bound
    c.last_peak = c.step_peak;
    c.step_peak = live_bytes();
  }
  c.enabled = enabled;
  if (enabled) {   // (between steps the blocks are mapped as in the last step)
    c.huge = cap == SIZE_MAX;
  }
  c.floor = enabled ? floor : 0;
  c.cap = enabled ? cap : SIZE_MAX;
  c.total = enabled ? total : SIZE_MAX;
  if (c.cap != SIZE_MAX) {
    bound_idle_locked(0);
  }
}

// The device pool now holds tensors in `used` bytes and has `idle` bytes of chunks holding
// none: the used bytes count as live, the idle ones share the bound with the cache.
void ooc_cpu_allocator_external(size_t used, size_t idle) {
  std::lock_guard<std::mutex> g(mu);
  c.external = used;
  c.idle_external = idle;
  note_live_locked();
  bound_idle_locked(0);
}

// Pages for a pool chunk of n bytes (a page multiple): the smallest cached block that holds
// them (split; the rest stays cached) or, on a miss, a fresh mapping made room for as a
// request's would be. They leave this allocator: the pool reports them as its own.
void* ooc_cpu_allocator_lend(size_t n) {
  std::lock_guard<std::mutex> g(mu);
  if (void* p = from_cache_locked(n)) {
    live.erase(p);   // not a block this allocator hands to PyTorch: nothing frees it here
    c.mapped -= n;
    return p;
  }
  // Not gathered: the pool moves a chunk with one mremap, which older kernels refuse across
  // the several mappings a gathered block is made of.
  c.misses++;
  bound_idle_locked(n);
  // nullptr: the pool maps its own and reports the error if that fails too
  Addr p = map_aligned(n);
  if (p != nullptr) {
    c.fresh += n;
  }
  return p;
}

// Make a CPU storage that PyTorch's default allocator made (a model's parameters, built
// before this allocator was installed) allocate through this one when it is resized: a storage
// keeps the allocator it was made with, so each swap-in of such a parameter asked glibc for
// fresh pages (mmap, zeroed by the kernel: ~50 MiB a step for VGG16 at 1/4 of its peak),
// memory the cache could neither serve nor see. With `move`, bytes it holds from elsewhere
// are copied into a block of this allocator first (their old block is freed at once): in
// glibc's heap, a parameter swapped out later would leave its pages there, resident, until the
// heap is trimmed at the step's end (VGG16's recording step with the update inside the
// backward peaked ~55 MiB higher). 0 for any other storage (another device, a custom or
// file-backed allocator, not resizable), left as it was; 1 if it allocates here now; 2 if
// its bytes were moved too.
int ooc_cpu_allocator_claim(void* impl, int move) {
  auto* s = static_cast<c10::StorageImpl*>(impl);
  if (s == nullptr || s->device_type() != c10::DeviceType::CPU) {
    return 0;
  }
  if (s->allocator() != &instance) {
    bool pytorchs = s->allocator() == previous || s->allocator() == c10::GetDefaultCPUAllocator();
    if (!s->resizable() || !pytorchs) {
      return 0;
    }
    s->set_allocator(&instance);
  }
  size_t n = s->nbytes();
  if (!move || n < kLarge || s->data_ptr().get_deleter() == &recycle_free) {
    return 1;
  }
  c10::DataPtr moved = instance.allocate(n);
  std::memcpy(moved.get(), s->data_ptr().get(), n);
  s->set_data_ptr_noswap(std::move(moved));
  return 2;
}

// A released pool chunk's n bytes of pages at p join the cache (merged with cached
// neighbours). Always taken: 1.
int ooc_cpu_allocator_adopt(void* ptr, size_t n) {
  std::lock_guard<std::mutex> g(mu);
  c.mapped += n;
  c.peak_mapped = std::max(c.peak_mapped, c.mapped);
  cache_locked(static_cast<Addr>(ptr), n);
  return 1;
}

// Unmap every cached block.
void ooc_cpu_allocator_release() {
  std::lock_guard<std::mutex> g(mu);
  shrink_locked(0);
}

// For each of `n` data pointers, out[i] = 1 if it starts a live large block of this allocator
// (its bytes are among live_bytes), else 0.
void ooc_cpu_allocator_owns(void* const* ptrs, size_t n, unsigned char* out) {
  std::lock_guard<std::mutex> g(mu);
  for (size_t i = 0; i < n; i++) {
    out[i] = live.count(ptrs[i]) ? 1 : 0;
  }
}

// cached, mapped, peak_mapped, hits, misses, floor, enabled, peak_live, external,
// idle_external, the bound's peak, fresh, gathered: the first `n` of them into out[0..n)
// (the caller says how many it has room for).
void ooc_cpu_allocator_stats(size_t* out, size_t n) {
  std::lock_guard<std::mutex> g(mu);
  const size_t all[] = {c.cached, c.mapped, c.peak_mapped, c.hits, c.misses, c.floor,
                        static_cast<size_t>(c.enabled), c.peak_live, c.external,
                        c.idle_external, std::max(c.step_peak, c.last_peak), c.fresh,
                        c.gathered, static_cast<size_t>(c.huge), multiple()};
  for (size_t i = 0; i < n && i < sizeof(all) / sizeof(all[0]); i++) {
    out[i] = all[i];
  }
}

}  // extern "C"
