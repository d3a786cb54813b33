// C++ ps-lite side of pslink's benchmarks/pslite_bench.py, with the same semantics: 1 server x 1
// worker, one key per request (value SIZE bytes of float32), INFLIGHT requests in flight as a
// sliding window, an untimed init push per key, a warm-up of 3*INFLIGHT ops, then a timed run
// sized to SECONDS; throughput = value bytes / s seen by the worker (MB = 1e6 B). The server adds
// pushes into its store and answers pulls from it without a copy, as pslink.pslite's
// KVServerDefaultHandle does. Built and run by pslink/bench/pslite_cpp.py.
// usage (as every role, under DMLC_* env): pslite_bench SIZE_BYTES zpush|zpull|zpushpull INFLIGHT SECONDS
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <random>
#include <string>
#include <unordered_map>
#include <vector>
#include "ps/ps.h"
using namespace ps;

struct StoreHandle {  // pslink.pslite.KVServerDefaultHandle's semantics, one key per request
  std::unordered_map<Key, SArray<float>> store;
  void operator()(const KVMeta& meta, const KVPairs<float>& req, KVServer<float>* server) {
    CHECK_EQ(req.keys.size(), 1U);
    Key key = req.keys[0];
    if (meta.push) {
      auto it = store.find(key);
      if (it == store.end()) {
        SArray<float> copy;
        copy.CopyFrom(req.vals);  // the received buffer is the transport's: keep a copy
        store[key] = copy;
      } else {
        SArray<float>& cur = it->second;
        CHECK_EQ(cur.size(), req.vals.size());
        const size_t n = cur.size();
        const float* v = req.vals.data();
        if (cur.ptr().use_count() > 1) {  // a pull reply still queued reads it: add into a new one
          SArray<float> fresh(n);
          float* d = fresh.data();
          const float* c = cur.data();
          for (size_t i = 0; i < n; ++i) d[i] = c[i] + v[i];
          cur = fresh;
        } else {
          float* c = cur.data();
          for (size_t i = 0; i < n; ++i) c[i] += v[i];
        }
      }
    }
    KVPairs<float> res;
    if (meta.pull) {  // answered from the store without a copy
      res.keys = req.keys;
      auto it = store.find(key);
      if (it == store.end()) res.vals = SArray<float>(1, 0.0f);
      else res.vals = it->second;
    }
    server->Response(meta, res);
  }
};

enum Op { PUSH, PULL, PUSHPULL };

static double RunOps(KVWorker<float>& kv, Op op, std::vector<SArray<Key>>& keys,
                     std::vector<SArray<float>>& vals, std::vector<SArray<float>>& outs,
                     int inflight, long count) {
  std::deque<int> pending;  // a sliding window of `inflight` requests
  auto t0 = std::chrono::steady_clock::now();
  for (long i = 0; i < count; ++i) {
    if ((int)pending.size() >= inflight) { kv.Wait(pending.front()); pending.pop_front(); }
    int j = i % inflight;
    if (op == PUSH) pending.push_back(kv.ZPush(keys[j], vals[j]));
    else if (op == PULL) pending.push_back(kv.ZPull(keys[j], &outs[j]));
    else pending.push_back(kv.ZPushPull(keys[j], vals[j], &outs[j]));
  }
  while (!pending.empty()) { kv.Wait(pending.front()); pending.pop_front(); }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

int main(int argc, char* argv[]) {
  if (argc < 5) { fprintf(stderr, "usage: %s SIZE OP INFLIGHT SECONDS\n", argv[0]); return 2; }
  const size_t size = strtoull(argv[1], nullptr, 10);
  const std::string ops = argv[2];
  const int inflight = atoi(argv[3]);
  const double seconds = atof(argv[4]);
  int opi = ops == "zpush" ? PUSH : ops == "zpull" ? PULL : ops == "zpushpull" ? PUSHPULL : -1;
  CHECK_GE(opi, 0) << "unknown op " << ops;
  Op op = static_cast<Op>(opi);
  // ps-lite's tests call Start(0) and then make the server, which races: Start's closing barrier
  // releases the worker, whose first push can reach the server before the server's own release,
  // and the server's one receive thread then waits (5 s, then aborts) for a customer that is only
  // made once that release, queued behind the push, is read. So the server registers its
  // customer first, then joins the same barrier Start(0) would have (untimed either way).
  StartAsync(0);
  if (IsServer()) {
    auto server = new KVServer<float>(0);
    server->set_request_handle(StoreHandle());
    RegisterExitCallback([server]() { delete server; });
  }
  Postoffice::Get()->Barrier(0, kWorkerGroup + kServerGroup + kScheduler);
  if (IsWorker()) {
    KVWorker<float> kv(0, 0);
    const size_t numel = size / 4;
    std::vector<SArray<Key>> keys;
    std::vector<SArray<float>> vals, outs;
    std::mt19937 rng(0);
    std::normal_distribution<float> nd;
    for (int j = 0; j < inflight; ++j) {
      keys.push_back(SArray<Key>(1, (Key)j));
      SArray<float> v(numel);
      for (size_t i = 0; i < numel; ++i) v[i] = nd(rng);
      vals.push_back(v);
      outs.push_back(SArray<float>(numel, 0.0f));
    }
    for (int j = 0; j < inflight; ++j) kv.Wait(kv.ZPush(keys[j], vals[j]));  // init push, untimed
    double warm = RunOps(kv, op, keys, vals, outs, inflight, 3 * inflight);
    double per_op = warm / (3 * inflight);
    long count = std::max<long>(5 * inflight, (long)(seconds / std::max(per_op, 1e-6)));
    double elapsed = RunOps(kv, op, keys, vals, outs, inflight, count);
    printf("PSLITE_CPP_RESULT {\"op\": \"%s\", \"size\": %zu, \"count\": %ld, \"seconds\": %.6f, \"MBps\": %.3f}\n",
           ops.c_str(), size, count, elapsed, count * (double)size / elapsed / 1e6);
    fflush(stdout);
  }
  Finalize(0, true);
  return 0;
}
