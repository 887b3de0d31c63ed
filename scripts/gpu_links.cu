// Host <-> GPU copies of scattered pages, as the simulator's link model describes them, timed from
// C++ (no Python in the issue loop): one cudaMemcpyAsync per segment, and one gather kernel reading
// the pinned host pages over PCIe (GPU-assisted I/O, Strata §4) or writing them (d2h).
// Build and run on the GPU machine: nvcc -O2 -arch=sm_90 -o gpu_links scripts/gpu_links.cu && ./gpu_links
// Prints one JSON object: rows of {method, direction, segment_bytes, segments, bytes, seconds, issue_s}.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#define CHECK(x)                                                                      \
  do {                                                                                \
    cudaError_t e = (x);                                                              \
    if (e != cudaSuccess) {                                                           \
      fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e)); \
      exit(1);                                                                        \
    }                                                                                 \
  } while (0)

// dst segment s <- src segment perm[s]; 16-byte words, grid (blocks per segment, segments).
__global__ void gather(const int4* src, int4* dst, const int* perm, size_t words) {
  const int4* s = src + (size_t)perm[blockIdx.y] * words;
  int4* d = dst + (size_t)blockIdx.y * words;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < words; i += (size_t)gridDim.x * blockDim.x)
    d[i] = s[i];
}

static double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int main() {
  const size_t total_max = size_t(1) << 30;
  char *host, *dev, *host_dev_ptr;
  CHECK(cudaHostAlloc(&host, total_max, cudaHostAllocMapped));
  CHECK(cudaHostGetDevicePointer((void**)&host_dev_ptr, host, 0));
  CHECK(cudaMalloc(&dev, total_max));
  memset(host, 7, total_max);
  CHECK(cudaMemset(dev, 3, total_max));
  int* perm_dev;
  CHECK(cudaMalloc(&perm_dev, sizeof(int) * (1 << 18)));
  cudaStream_t stream;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  std::mt19937 rng(0);
  printf("{\"rows\": [\n");
  bool first = true;
  const size_t segs[] = {4 << 10, 16 << 10, 32 << 10, 64 << 10, 128 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20};
  for (size_t seg : segs) {
    size_t total = std::max<size_t>(64 << 20, std::min<size_t>(total_max, seg * 8192));
    size_t n = total / seg;
    std::vector<int> perm(n);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    CHECK(cudaMemcpy(perm_dev, perm.data(), sizeof(int) * n, cudaMemcpyHostToDevice));
    for (int dir = 0; dir < 2; ++dir) {
      for (int method = 0; method < 2; ++method) {
        std::vector<double> gpu_s, issue_s;
        for (int rep = 0; rep < 6; ++rep) {
          auto t0 = std::chrono::steady_clock::now();
          CHECK(cudaEventRecord(a, stream));
          if (method == 0) {  // one cudaMemcpyAsync per segment, scattered source pages
            for (size_t s = 0; s < n; ++s) {
              if (dir == 0)
                CHECK(cudaMemcpyAsync(dev + s * seg, host + (size_t)perm[s] * seg, seg, cudaMemcpyHostToDevice, stream));
              else
                CHECK(cudaMemcpyAsync(host + s * seg, dev + (size_t)perm[s] * seg, seg, cudaMemcpyDeviceToHost, stream));
            }
          } else {  // one gather kernel over mapped host memory
            size_t words = seg / 16;
            unsigned bx = (unsigned)std::max<size_t>(1, std::min<size_t>(64, words / (256 * 8)));
            dim3 grid(bx, (unsigned)n);
            if (dir == 0)
              gather<<<grid, 256, 0, stream>>>((const int4*)host_dev_ptr, (int4*)dev, perm_dev, words);
            else
              gather<<<grid, 256, 0, stream>>>((const int4*)dev, (int4*)host_dev_ptr, perm_dev, words);
            CHECK(cudaGetLastError());
          }
          CHECK(cudaEventRecord(b, stream));
          auto t1 = std::chrono::steady_clock::now();
          CHECK(cudaEventSynchronize(b));
          float ms;
          CHECK(cudaEventElapsedTime(&ms, a, b));
          if (rep > 0) {  // the first is a warm-up
            gpu_s.push_back(ms / 1e3);
            issue_s.push_back(std::chrono::duration<double>(t1 - t0).count());
          }
        }
        printf("%s{\"method\": \"%s\", \"direction\": \"%s\", \"segment_bytes\": %zu, \"segments\": %zu, "
               "\"bytes\": %zu, \"seconds\": %.9g, \"issue_s\": %.9g}",
               first ? "" : ",\n", method == 0 ? "memcpy_async_per_segment" : "gather_kernel",
               dir == 0 ? "h2d" : "d2h", seg, n, n * seg, median(gpu_s), median(issue_s));
        first = false;
        fflush(stdout);
      }
    }
  }
  // Check the gather moved the right bytes: segment 0 of dev holds host segment perm[0] (all 7s).
  char probe[16];
  CHECK(cudaMemcpy(probe, dev, 16, cudaMemcpyDeviceToHost));
  printf("\n], \"check_ok\": %s}\n", probe[0] == 7 ? "true" : "false");
  return 0;
}
