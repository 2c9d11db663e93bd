// tokenmill CPU kernels: what the library says about itself, and its thread count.
#include "tm.h"
#include "vec.h"

#ifndef TM_SOURCE_HASH
#define TM_SOURCE_HASH "unknown"
#endif

namespace tm {
int g_threads = 1;
int g_stream_nta = 0;
int64_t g_q6_widen_rows = 32;
}

extern "C" {

int tm_abi_version(void) { return TM_ABI_VERSION; }
const char* tm_isa(void) { return tm::kIsa; }
const char* tm_source_hash(void) { return TM_SOURCE_HASH; }
void tm_set_num_threads(int threads) { tm::g_threads = threads > 0 ? threads : 1; }
void tm_set_stream_prefetch(int nta) { tm::g_stream_nta = nta != 0; }
void tm_set_q6_widen_rows(int64_t rows) { tm::g_q6_widen_rows = rows > 1 ? rows : 1; }

}  // extern "C"
