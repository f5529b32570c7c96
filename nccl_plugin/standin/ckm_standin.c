/* The NCCL stand-in's version (testbed/nccl_harness.py): ncclGetVersion as libnccl exports
 * it, answering NCCL_STANDIN_VERSION (a version code, e.g. 22907). The harness loads this
 * library with RTLD_GLOBAL before the plugin, as a process running NCCL has libnccl loaded,
 * so the plugin learns "the running release" by the same dlsym it uses under real NCCL. */
#include <stdlib.h>

#define EXPORT __attribute__((visibility("default")))

EXPORT int ncclGetVersion(int *version)
{
	const char *v = getenv("NCCL_STANDIN_VERSION");
	if (!version)
		return 4; /* ncclInvalidArgument */
	*version = v && *v ? atoi(v) : 0;
	return 0;
}
