// Work that the calling thread shares with helper threads on spare cores: cores that other
// processes (the serving path) use part of the time, which the helpers take only while nothing
// else wants them (Linux SCHED_IDLE).
//
// A job is cut into chunks. The caller's torch threads and the helpers claim chunks from one
// counter. The caller's threads write their results in place; a helper computes into a scratch
// buffer of its own and copies it into place only if its chunk is still its own. A helper can
// be preempted at any moment, for as long as the serving path runs, so the caller never waits
// for one: once no chunk is left to claim, it takes over every chunk a helper is still
// computing and waits only for copies already under way. A chunk may be cut in parts that a
// helper copies into place one by one: the caller then takes back only the parts not yet in
// place, and the helper, finding its chunk taken, drops it at the end of the part it is at
// (instead of computing the rest of a chunk that is no longer its own while the caller's next
// job waits for it). A helper may thus still read a job's inputs after the caller returned: a
// job keeps what it reads alive (it is held by a shared_ptr) and writes nothing in place after
// the caller returns.
// Between jobs a helper spins for a few milliseconds before it sleeps: a step's jobs follow each
// other by microseconds, and waking a sleeping thread for each cost the helper the first part of
// every job (a decode step with the helper on an idle core took ~18 % longer than with two torch
// threads; with the spin, about as long). Spinning at idle priority takes only idle time.
#pragma once

#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <utility>
#include <vector>

namespace serve_app_cpu {

class SharedJob {
 public:
  explicit SharedJob(int64_t chunks);
  virtual ~SharedJob() = default;

  // The parts of chunk c that a helper puts in place one at a time (1: the whole chunk at once)
  virtual int64_t parts(int64_t c) const {
    (void)c;
    return 1;
  }
  // chunk c from part `from` on, written in place (the caller's threads; `from` > 0: the parts
  // before it are in place, a helper's)
  virtual void run(int64_t c, int64_t from) = 0;
  // part `part` of chunk c into `scratch` (a helper), and later, if the chunk is still the
  // helper's, copied into place
  virtual void run_into(int64_t c, int64_t part, std::vector<char>& scratch) = 0;
  virtual void commit(int64_t c, int64_t part, const std::vector<char>& scratch) = 0;

  const int64_t chunks;
  std::atomic<int64_t> next{0};                  // the next chunk to claim
  std::unique_ptr<std::atomic<int>[]> state;    // per chunk: who has it (spare_cores.cpp)
  std::unique_ptr<std::atomic<int64_t>[]> placed;  // per chunk: parts a helper put in place
};

// How many helper threads are running (0: `run_shared` is not worth calling).
int64_t spare_helpers();

// Runs every chunk of `job` on the caller's torch threads (at::parallel_for) and the helpers;
// returns once every chunk's result is in place.
void run_shared(const std::shared_ptr<SharedJob>& job);

// A job whose chunk c computes units [bounds[c], bounds[c + 1]) of a dense output, `unit`
// elements of T per unit: `compute(begin, end, into)` writes units begin..end-1 from `into` on.
// `keep` holds what the inputs need to stay alive (a helper may still compute a chunk the caller
// took back after the caller returned).
template <typename T, typename Compute, typename Keep>
class DenseJob final : public SharedJob {
 public:
  DenseJob(std::vector<int64_t> bounds, int64_t unit, T* out, Compute compute, Keep keep)
      : SharedJob(static_cast<int64_t>(bounds.size()) - 1),
        bounds_(std::move(bounds)),
        unit_(unit),
        out_(out),
        compute_(std::move(compute)),
        keep_(std::move(keep)) {}

  void run(int64_t c, int64_t from) override {  // (one part: from is 0)
    (void)from;
    compute_(bounds_[c], bounds_[c + 1], out_ + bounds_[c] * unit_);
  }

  void run_into(int64_t c, int64_t part, std::vector<char>& scratch) override {
    (void)part;
    scratch.resize(bytes(c));
    compute_(bounds_[c], bounds_[c + 1], reinterpret_cast<T*>(scratch.data()));
  }

  void commit(int64_t c, int64_t part, const std::vector<char>& scratch) override {
    (void)part;
    std::memcpy(out_ + bounds_[c] * unit_, scratch.data(), bytes(c));
  }

 private:
  size_t bytes(int64_t c) const {
    return static_cast<size_t>((bounds_[c + 1] - bounds_[c]) * unit_) * sizeof(T);
  }

  const std::vector<int64_t> bounds_;
  const int64_t unit_;
  T* const out_;
  const Compute compute_;
  const Keep keep_;
};

// Runs a DenseJob over `bounds` (two chunks or more) with the helpers; see run_shared.
template <typename T, typename Compute, typename Keep>
void run_dense(std::vector<int64_t> bounds, int64_t unit, T* out, Compute compute, Keep keep) {
  run_shared(std::make_shared<DenseJob<T, Compute, Keep>>(std::move(bounds), unit, out,
                                                          std::move(compute), std::move(keep)));
}

}  // namespace serve_app_cpu
