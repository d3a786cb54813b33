// C++ ps-lite side of pslink's benchmarks/sparse.py: ps-lite's tests/test_kv_app.cc pattern,
// timed. Each worker pushes NUM keys of one float in one Push (keys spread over the key space),
// at most WINDOW pushes in flight, REPEAT times; then REPEAT pulls of the same keys; then REPEAT
// serial pushpulls. Servers run KVServerDefaultHandle (store[key] += value).
// usage (as every role, under DMLC_* env): kv_many NUM REPEAT WINDOW
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <vector>
#include "ps/ps.h"
using namespace ps;

static double Seconds(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

int main(int argc, char* argv[]) {
  if (argc < 4) { fprintf(stderr, "usage: %s NUM REPEAT WINDOW\n", argv[0]); return 2; }
  const int num = atoi(argv[1]), repeat = atoi(argv[2]), window = atoi(argv[3]);
  // ps-lite's tests call Start(0) and then make the server, which races: Start's closing barrier
  // releases the worker, whose first push can reach the server before the server's own release,
  // and the server's one receive thread then waits (5 s, then aborts) for a customer that is only
  // made once that release, queued behind the push, is read. So the server registers its
  // customer first, then joins the same barrier Start(0) would have (untimed either way).
  StartAsync(0);
  if (IsServer()) {
    auto server = new KVServer<float>(0);
    server->set_request_handle(KVServerDefaultHandle<float>());
    RegisterExitCallback([server]() { delete server; });
  }
  Postoffice::Get()->Barrier(0, kWorkerGroup + kServerGroup + kScheduler);
  if (IsWorker()) {
    KVWorker<float> kv(0, 0);
    std::vector<Key> keys(num);
    std::vector<float> vals(num);
    for (int i = 0; i < num; ++i) { keys[i] = kMaxKey / num * i; vals[i] = (float)(i % 1000); }
    kv.Wait(kv.Push(keys, vals));  // first touch, untimed
    auto t0 = std::chrono::steady_clock::now();
    std::deque<int> pending;
    for (int i = 0; i < repeat; ++i) {
      if ((int)pending.size() >= window) { kv.Wait(pending.front()); pending.pop_front(); }
      pending.push_back(kv.Push(keys, vals));
    }
    while (!pending.empty()) { kv.Wait(pending.front()); pending.pop_front(); }
    double push = Seconds(t0);
    std::vector<float> rets;
    t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < repeat; ++i) kv.Wait(kv.Pull(keys, &rets));
    double pull = Seconds(t0);
    std::vector<float> outs;
    t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < repeat; ++i) kv.Wait(kv.PushPull(keys, vals, &outs));
    double pushpull = Seconds(t0);
    double error = 0;  // every value is (2 repeat + 1) pushes of it, from this worker
    for (int i = 0; i < num; ++i) error += std::abs(outs[i] - vals[i] * (2 * repeat + 1));
    printf("KV_MANY_RESULT {\"push\": %.6f, \"pull\": %.6f, \"pushpull\": %.6f, \"error\": %g}\n",
           push, pull, pushpull, error);
    fflush(stdout);
  }
  Finalize(0, true);
  return 0;
}
