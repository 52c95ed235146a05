// Where the GPU sits idle in a step: a CUPTI activity trace of every kernel, copy and
// memset a program runs, with the runtime calls that make the host wait, written as CSV
// when the program exits. Nothing in moetrain changes: the CUDA driver loads this
// library into any program through CUDA_INJECTION64_PATH.
//
//   (built with the CUDA backend: BUILD/libkernel_trace.so; carry libcupti.so.13 along)
//   CUDA_INJECTION64_PATH=$PWD/libkernel_trace.so KERNEL_TRACE=trace.csv moetrain train ...
//   python3 bench/kernel_trace.py trace.csv
//
// Rows: kind (kernel, copy, set, wait), start and end in ns (the GPU's clock for work, the
// same clock for the host's waits), stream, name. A "wait" is a runtime call that blocks
// the host until the device catches up (stream, event or device synchronisation, a
// synchronous copy), kept when it lasted at least 5 us.
#include <cupti.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

namespace {

constexpr size_t kBufferBytes = 8 << 20;

struct Row {
  const char* kind;
  uint64_t start, end;
  uint32_t stream;
  std::string name;
};

std::mutex g_mutex;
std::vector<Row>* g_rows = new std::vector<Row>();  // never freed: read at exit

void check(CUptiResult r, const char* what) {
  if (r == CUPTI_SUCCESS) return;
  const char* text = nullptr;
  cuptiGetResultString(r, &text);
  std::fprintf(stderr, "kernel_trace: %s failed: %s\n", what, text != nullptr ? text : "?");
  std::exit(1);
}

bool is_wait(CUpti_CallbackId id) {
  switch (id) {
    case CUPTI_RUNTIME_TRACE_CBID_cudaStreamSynchronize_v3020:
    case CUPTI_RUNTIME_TRACE_CBID_cudaEventSynchronize_v3020:
    case CUPTI_RUNTIME_TRACE_CBID_cudaDeviceSynchronize_v3020:
    case CUPTI_RUNTIME_TRACE_CBID_cudaMemcpy_v3020:
    case CUPTI_RUNTIME_TRACE_CBID_cudaFree_v3020:
    case CUPTI_RUNTIME_TRACE_CBID_cudaFreeHost_v3020:
    case CUPTI_RUNTIME_TRACE_CBID_cudaMallocHost_v3020:
      return true;
    default:
      return false;
  }
}

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, kBufferBytes));
  *size = kBufferBytes;
  *max_records = 0;
}

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  CUpti_Activity* record = nullptr;
  std::vector<Row> rows;
  while (cuptiActivityGetNextRecord(buffer, valid, &record) == CUPTI_SUCCESS) {
    switch (record->kind) {
      case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL:
      case CUPTI_ACTIVITY_KIND_KERNEL: {
        auto* k = reinterpret_cast<CUpti_ActivityKernel10*>(record);
        rows.push_back({"kernel", k->start, k->end, k->streamId, k->name != nullptr ? k->name : "?"});
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMCPY: {
        auto* m = reinterpret_cast<CUpti_ActivityMemcpy6*>(record);
        rows.push_back({"copy", m->start, m->end, m->streamId, "copy " + std::to_string(m->bytes) + " bytes"});
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMSET: {
        auto* m = reinterpret_cast<CUpti_ActivityMemset4*>(record);
        rows.push_back({"set", m->start, m->end, m->streamId, "memset " + std::to_string(m->bytes) + " bytes"});
        break;
      }
      case CUPTI_ACTIVITY_KIND_RUNTIME: {
        auto* a = reinterpret_cast<CUpti_ActivityAPI*>(record);
        if (!is_wait(a->cbid) || a->end - a->start < 5000) break;
        const char* name = nullptr;
        cuptiGetCallbackName(CUPTI_CB_DOMAIN_RUNTIME_API, a->cbid, &name);
        rows.push_back({"wait", a->start, a->end, 0, name != nullptr ? name : "?"});
        break;
      }
      default:
        break;
    }
  }
  std::free(buffer);
  std::lock_guard<std::mutex> lock(g_mutex);
  for (Row& r : rows) g_rows->push_back(std::move(r));
}

void write_trace() {
  check(cuptiActivityFlushAll(1), "cuptiActivityFlushAll");
  const char* path = std::getenv("KERNEL_TRACE");
  FILE* f = std::fopen(path != nullptr ? path : "kernel_trace.csv", "w");
  if (f == nullptr) {
    std::fprintf(stderr, "kernel_trace: cannot write %s\n", path != nullptr ? path : "kernel_trace.csv");
    return;
  }
  std::lock_guard<std::mutex> lock(g_mutex);
  std::fprintf(f, "kind,start,end,stream,name\n");
  for (const Row& r : *g_rows) {
    std::string name = r.name;
    for (char& c : name)
      if (c == ',' || c == '\n') c = ';';
    std::fprintf(f, "%s,%llu,%llu,%u,%s\n", r.kind, static_cast<unsigned long long>(r.start),
                 static_cast<unsigned long long>(r.end), r.stream, name.c_str());
  }
  std::fclose(f);
  std::fprintf(stderr, "kernel_trace: %zu rows\n", g_rows->size());
}

}  // namespace

extern "C" int InitializeInjection() {
  check(cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed), "cuptiActivityRegisterCallbacks");
  for (CUpti_ActivityKind k : {CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, CUPTI_ACTIVITY_KIND_MEMCPY,
                               CUPTI_ACTIVITY_KIND_MEMSET, CUPTI_ACTIVITY_KIND_RUNTIME})
    check(cuptiActivityEnable(k), "cuptiActivityEnable");
  std::atexit(write_trace);
  return 1;
}
