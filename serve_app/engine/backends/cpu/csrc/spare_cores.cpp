// Helper threads on spare cores (spare_cores.h), and the ops that start them and count their
// work:
//
// use_spare_cpus(int[] cpus, int helper_delay_us=0, int team_delay_us=0, int spin_us=5000,
//                int part_delay_us=0) -> int
//   One helper thread per core in `cpus` (replacing any started before; [] stops them), each
//   bound to its core at SCHED_IDLE: it runs only while nothing else wants the core. Returns
//   how many run. After each job a helper spins up to `spin_us` for the next before it sleeps
//   (waking a sleeping thread takes longer than the gaps between a step's jobs). The delays
//   are for tests: helpers (or the caller's threads) sleep that long before each chunk, so that
//   the caller takes chunks back from late helpers (or helpers get chunks at all on a busy
//   machine); helpers sleep `part_delay_us` before each part of a chunk after its first, so
//   that the caller takes back a chunk with parts in place.
// spare_cores_stats() -> int[]
//   Since the process started: chunks done by the caller's threads, by helpers, and taken back
//   from helpers that were late; jobs helpers found awake, and only after they slept; parts of
//   chunks taken back that their helper had put in place (the caller computed the rest).
//
// torch.ops.serve_app_cpu.use_spare_cpus and spare_cores_stats (ops.cpp).

#include "spare_cores.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include "ops.h"

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>

#if defined(__linux__)
#include <pthread.h>
#include <sched.h>
#endif
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace serve_app_cpu {

namespace {

// A chunk's owner: nobody yet (its claimer has not marked it), the caller's threads, a helper
// computing it, a helper copying its result into place, taken back from a helper by the caller.
enum ChunkState : int { kFree = 0, kTeam, kHelper, kCommitting, kTaken, kDone };

void pause() {
#if defined(__x86_64__)
  _mm_pause();
#else
  std::this_thread::yield();
#endif
}

void sleep_us(int64_t us) {
  if (us > 0) std::this_thread::sleep_for(std::chrono::microseconds(us));
}

// The next chunk of `job` from its counter, marked as `owner`'s (kTeam or kHelper); -1 once none
// is left. A chunk taken back before its claimer marked it is skipped.
int64_t claim(SharedJob& job, int owner) {
  for (;;) {
    const int64_t c = job.next.fetch_add(1, std::memory_order_relaxed);
    if (c >= job.chunks) return -1;
    int expected = kFree;
    if (job.state[c].compare_exchange_strong(expected, owner, std::memory_order_acq_rel)) {
      return c;
    }
  }
}

class Pool {
 public:
  int64_t start(const std::vector<int64_t>& cpus, int64_t helper_delay_us, int64_t team_delay_us,
                int64_t spin_us, int64_t part_delay_us) {
    stop_all();
    helper_delay_us_ = helper_delay_us;
    team_delay_us_ = team_delay_us;
    part_delay_us_ = part_delay_us;
    spin_ = std::chrono::microseconds(spin_us);
    for (const int64_t cpu : cpus) {
      threads_.emplace_back([this] { loop(); });
      const std::string problem = place(threads_.back(), cpu);
      if (!problem.empty()) {
        stop_all();
        TORCH_CHECK(false, "use_spare_cpus: core ", cpu, ": ", problem);
      }
    }
    count_.store(static_cast<int64_t>(threads_.size()), std::memory_order_release);
    return static_cast<int64_t>(threads_.size());
  }

  int64_t count() const { return count_.load(std::memory_order_acquire); }

  // The caller takes the lock only to set the job; a helper holds it only to read the job when
  // it wakes. A helper preempted right there (idle priority) would hold up the caller until the
  // core is idle again: a window of a few instructions per GEMM, accepted for the plain lock.
  void publish(const std::shared_ptr<SharedJob>& job) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      job_ = job;
      generation_.fetch_add(1, std::memory_order_release);
    }
    wake_.notify_all();
  }

  void retire(const SharedJob* job) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (job_.get() == job) job_.reset();
  }

  int64_t team_delay_us() const { return team_delay_us_; }

  std::atomic<int64_t> team_chunks{0}, helper_chunks{0}, taken_chunks{0};
  // jobs a helper found while awake (spinning after the last one), and after it slept
  std::atomic<int64_t> jobs_awake{0}, jobs_woken{0};
  std::atomic<int64_t> parts_kept{0};  // of chunks taken back: parts their helper had placed

 private:
  // the helper on `cpu` at SCHED_IDLE; "" or what went wrong
  static std::string place(std::thread& thread, int64_t cpu) {
#if defined(__linux__)
    if (cpu < 0 || cpu >= CPU_SETSIZE) return "not a core id";
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(static_cast<int>(cpu), &set);
    if (pthread_setaffinity_np(thread.native_handle(), sizeof(set), &set) != 0) {
      return "not available to this process";
    }
    sched_param param{};
    param.sched_priority = 0;
    if (pthread_setschedparam(thread.native_handle(), SCHED_IDLE, &param) != 0) {
      return "SCHED_IDLE refused";
    }
    return "";
#else
    (void)thread;
    (void)cpu;
    return "helpers on spare cores need Linux";
#endif
  }

  void stop_all() {
    count_.store(0, std::memory_order_release);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_all();
    for (auto& thread : threads_) thread.join();
    threads_.clear();
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = false;
  }

  void loop() {
    std::vector<char> scratch;
    uint64_t seen = 0;
    for (;;) {
      spin_for_next(seen);
      std::shared_ptr<SharedJob> job;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        const auto ready = [&] {
          return stopping_ || (generation_.load(std::memory_order_relaxed) != seen && job_);
        };
        const bool awake = ready();
        if (!awake) wake_.wait(lock, ready);
        if (stopping_) return;
        seen = generation_.load(std::memory_order_relaxed);
        job = job_;
        (awake ? jobs_awake : jobs_woken).fetch_add(1, std::memory_order_relaxed);
      }
      work(*job, scratch);
    }
  }

  // Waits up to spin_ for the next job without sleeping: a step's jobs follow each other by tens
  // of microseconds, less than waking a sleeping thread takes, and the spinning costs nothing
  // but idle time (anything else that wants the core preempts a SCHED_IDLE thread at once).
  void spin_for_next(uint64_t seen) const {
    const auto until = std::chrono::steady_clock::now() + spin_;
    while (generation_.load(std::memory_order_acquire) == seen &&
           count_.load(std::memory_order_relaxed) > 0) {
      for (int i = 0; i < 64; ++i) pause();
      if (std::chrono::steady_clock::now() >= until) return;
    }
  }

  // Each claimed chunk part by part, each part copied into place while the chunk is still the
  // helper's; a chunk the caller took back is dropped at the end of the part under way.
  void work(SharedJob& job, std::vector<char>& scratch) {
    for (int64_t c; (c = claim(job, kHelper)) >= 0;) {
      sleep_us(helper_delay_us_);
      const int64_t parts = job.parts(c);
      for (int64_t part = 0; part < parts; ++part) {
        if (part > 0) sleep_us(part_delay_us_);
        if (job.state[c].load(std::memory_order_relaxed) != kHelper) break;
        job.run_into(c, part, scratch);
        int expected = kHelper;
        if (!job.state[c].compare_exchange_strong(expected, kCommitting,
                                                  std::memory_order_acq_rel)) {
          break;  // taken back
        }
        job.commit(c, part, scratch);
        job.placed[c].store(part + 1, std::memory_order_relaxed);  // published by the store:
        const bool last = part + 1 == parts;
        job.state[c].store(last ? kDone : kHelper, std::memory_order_release);
        if (last) helper_chunks.fetch_add(1, std::memory_order_relaxed);
      }
    }
  }

  std::mutex mutex_;
  std::condition_variable wake_;
  std::shared_ptr<SharedJob> job_;
  std::atomic<uint64_t> generation_{0};
  bool stopping_ = false;
  std::vector<std::thread> threads_;
  std::atomic<int64_t> count_{0};
  int64_t helper_delay_us_ = 0, team_delay_us_ = 0, part_delay_us_ = 0;
  std::chrono::microseconds spin_{0};
};

Pool& pool() {
  static Pool* instance = new Pool();  // never destroyed: helpers may run until the process ends
  return *instance;
}

// One of the caller's threads: claim chunks until none is left, then take back every chunk a
// helper has not finished: the parts it has not put in place yet (waiting out a part it is
// copying).
void team_work(SharedJob& job, Pool& p) {
  for (int64_t c; (c = claim(job, kTeam)) >= 0;) {
    sleep_us(p.team_delay_us());
    job.run(c, 0);
    p.team_chunks.fetch_add(1, std::memory_order_relaxed);
  }
  for (int64_t c = 0; c < job.chunks; ++c) {
    for (int seen = job.state[c].load(std::memory_order_acquire);;) {
      if (seen == kCommitting) {  // a part on its way into place: a copy's time
        pause();
        seen = job.state[c].load(std::memory_order_acquire);
        continue;
      }
      if (seen != kFree && seen != kHelper) break;  // the caller's, or done
      if (job.state[c].compare_exchange_weak(seen, kTaken, std::memory_order_acq_rel)) {
        // the parts before `placed` are in place: the helper's stores to them, and to
        // `placed`, came before the state this exchange replaced
        const int64_t placed = seen == kHelper ? job.placed[c].load(std::memory_order_relaxed) : 0;
        job.run(c, placed);
        p.taken_chunks.fetch_add(1, std::memory_order_relaxed);
        p.parts_kept.fetch_add(placed, std::memory_order_relaxed);
        break;
      }
    }
  }
}

}  // namespace

SharedJob::SharedJob(int64_t chunks)
    : chunks(chunks),
      state(new std::atomic<int>[chunks]),
      placed(new std::atomic<int64_t>[chunks]) {
  for (int64_t c = 0; c < chunks; ++c) {
    state[c].store(kFree, std::memory_order_relaxed);
    placed[c].store(0, std::memory_order_relaxed);
  }
}

int64_t spare_helpers() { return pool().count(); }

void run_shared(const std::shared_ptr<SharedJob>& job) {
  Pool& p = pool();
  p.publish(job);
  const int64_t team = at::get_num_threads();
  at::parallel_for(0, team, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) team_work(*job, p);
  });
  p.retire(job.get());  // (team_work left no chunk being copied)
}

int64_t use_spare_cpus(c10::ArrayRef<int64_t> cpus, int64_t helper_delay_us,
                       int64_t team_delay_us, int64_t spin_us, int64_t part_delay_us) {
  return pool().start(cpus.vec(), helper_delay_us, team_delay_us, spin_us,
                                     part_delay_us);
}

std::vector<int64_t> spare_cores_stats() {
  auto& p = pool();
  return {p.team_chunks.load(), p.helper_chunks.load(), p.taken_chunks.load(),
          p.jobs_awake.load(), p.jobs_woken.load(), p.parts_kept.load()};
}

}  // namespace serve_app_cpu
