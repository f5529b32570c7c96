/* The NCCL network-plugin ABI (ncclNet_v10, v11, v12), declared from NCCL's documented
 * plugin interface (plugins/net in NVIDIA/nccl). Written here, not copied: only the layout
 * matters, and tests/test_nccl_abi.py checks every size and offset against the documented
 * layout (LP64: pointers and size_t 8 bytes, int 4, enums int-sized). */
#ifndef CKM_NCCL_ABI_H
#define CKM_NCCL_ABI_H

#include <stddef.h>
#include <stdint.h>

typedef enum {
	ncclSuccess = 0,
	ncclUnhandledCudaError = 1,
	ncclSystemError = 2,
	ncclInternalError = 3,
	ncclInvalidArgument = 4,
	ncclInvalidUsage = 5,
	ncclRemoteError = 6,
	ncclInProgress = 7,
} ncclResult_t;

typedef enum { NCCL_LOG_NONE = 0, NCCL_LOG_VERSION = 1, NCCL_LOG_WARN = 2, NCCL_LOG_INFO = 3,
	       NCCL_LOG_ABORT = 4, NCCL_LOG_TRACE = 5 } ncclDebugLogLevel;
#define CKM_NCCL_SUBSYS_NET 16

typedef void (*ncclDebugLogger_t)(ncclDebugLogLevel level, unsigned long flags, const char *file,
				  int line, const char *fmt, ...);
typedef ncclResult_t (*ncclProfilerCallback_t)(void **eHandle, int type, void *phandle,
					       int64_t pluginId, void *extData);

#define NCCL_NET_HANDLE_MAXSIZE 128
#define NCCL_PTR_HOST 0x1
#define NCCL_PTR_CUDA 0x2
#define NCCL_PTR_DMABUF 0x4
#define NCCL_NET_MAX_REQUESTS 32
#define NCCL_NET_ID_UNDEF (-1)
#define CKM_NCCL_MAX_NET_SIZE (1024L * 1024 * 1024 * 1024) /* NCCL_MAX_NET_SIZE_BYTES, 1 TB */

typedef enum { NCCL_NET_DEVICE_HOST = 0, NCCL_NET_DEVICE_UNPACK = 1 } ncclNetDeviceType;

typedef struct {
	ncclNetDeviceType netDeviceType;
	int netDeviceVersion;
	void *handle;
	size_t size;
	int needsProxyProgress;
} ncclNetDeviceHandle_t; /* v7 .. v12 share this layout */

/* v10 and v11 list up to 4 devices per virtual NIC, v12 up to 8. */
typedef struct { int ndevs; int devs[4]; } ncclNetVDeviceProps_v10_t;
typedef struct { int ndevs; int devs[8]; } ncclNetVDeviceProps_v12_t;

typedef struct { int trafficClass; } ncclNetCommConfig_t; /* v10 .. v12 */

#define CKM_NCCL_PROPS_COMMON(VPROPS)                                                        \
	char *name;                                                                         \
	char *pciPath;                                                                      \
	uint64_t guid;                                                                      \
	int ptrSupport;                                                                     \
	int regIsGlobal;                                                                    \
	int forceFlush;                                                                     \
	int speed;                                                                          \
	int port;                                                                           \
	float latency;                                                                      \
	int maxComms;                                                                       \
	int maxRecvs;                                                                       \
	ncclNetDeviceType netDeviceType;                                                    \
	int netDeviceVersion;                                                               \
	VPROPS vProps;                                                                      \
	size_t maxP2pBytes;                                                                 \
	size_t maxCollBytes;

typedef struct {
	CKM_NCCL_PROPS_COMMON(ncclNetVDeviceProps_v10_t)
} ncclNetProperties_v10_t;

typedef struct {
	CKM_NCCL_PROPS_COMMON(ncclNetVDeviceProps_v10_t)
	int maxMultiRequestSize;
} ncclNetProperties_v11_t;

typedef struct {
	CKM_NCCL_PROPS_COMMON(ncclNetVDeviceProps_v12_t)
	int maxMultiRequestSize;
	int16_t railId;
	int16_t planeId;
} ncclNetProperties_v12_t;

typedef struct {
	int32_t maxConcurrentPeers;
	int32_t minConcurrentPeers;
	int32_t maxFlowsPerPeer;
	int32_t minFlowsPerPeer;
} ncclNetCommAttr_t;

typedef struct {
	ncclNetCommAttr_t sendCommAttr;
	ncclNetCommAttr_t recvCommAttr;
	uint32_t op;
	uint32_t algo;
	uint32_t proto;
} ncclNetAttr_t; /* v11, v12 */

/* The members every version from v10 on has after getProperties, in order. */
#define CKM_NCCL_NET_TAIL(VPROPS)                                                            \
	ncclResult_t (*regMr)(void *comm, void *data, size_t size, int type, void **mhandle);   \
	ncclResult_t (*regMrDmaBuf)(void *comm, void *data, size_t size, int type,              \
				    uint64_t offset, int fd, void **mhandle);                   \
	ncclResult_t (*deregMr)(void *comm, void *mhandle);                                     \
	ncclResult_t (*isend)(void *sendComm, void *data, size_t size, int tag, void *mhandle,  \
			      void *phandle, void **request);                                   \
	ncclResult_t (*irecv)(void *recvComm, int n, void **data, size_t *sizes, int *tags,     \
			      void **mhandles, void **phandles, void **request);                \
	ncclResult_t (*iflush)(void *recvComm, int n, void **data, int *sizes, void **mhandles, \
			       void **request);                                                 \
	ncclResult_t (*test)(void *request, int *done, int *sizes);                             \
	ncclResult_t (*closeSend)(void *sendComm);                                              \
	ncclResult_t (*closeRecv)(void *recvComm);                                              \
	ncclResult_t (*closeListen)(void *listenComm);                                          \
	ncclResult_t (*getDeviceMr)(void *comm, void *mhandle, void **dptr_mhandle);            \
	ncclResult_t (*irecvConsumed)(void *recvComm, int n, void *request);                    \
	ncclResult_t (*makeVDevice)(int *d, VPROPS *props);

typedef struct {
	const char *name;
	ncclResult_t (*init)(ncclDebugLogger_t logFunction, ncclProfilerCallback_t profFunction);
	ncclResult_t (*devices)(int *ndev);
	ncclResult_t (*getProperties)(int dev, ncclNetProperties_v10_t *props);
	ncclResult_t (*listen)(int dev, void *handle, void **listenComm);
	ncclResult_t (*connect)(int dev, ncclNetCommConfig_t *config, void *handle,
				void **sendComm, ncclNetDeviceHandle_t **sendDevComm);
	ncclResult_t (*accept)(void *listenComm, void **recvComm,
			       ncclNetDeviceHandle_t **recvDevComm);
	CKM_NCCL_NET_TAIL(ncclNetVDeviceProps_v10_t)
} ncclNet_v10_t;

#define CKM_NCCL_NET_V11_LIKE(PROPS, VPROPS)                                                 \
	const char *name;                                                                   \
	ncclResult_t (*init)(void **ctx, uint64_t commId, ncclNetCommConfig_t *config,          \
			     ncclDebugLogger_t logFunction, ncclProfilerCallback_t profFunction); \
	ncclResult_t (*devices)(int *ndev);                                                     \
	ncclResult_t (*getProperties)(int dev, PROPS *props);                                   \
	ncclResult_t (*listen)(void *ctx, int dev, void *handle, void **listenComm);            \
	ncclResult_t (*connect)(void *ctx, int dev, void *handle, void **sendComm,              \
				ncclNetDeviceHandle_t **sendDevComm);                           \
	ncclResult_t (*accept)(void *listenComm, void **recvComm,                               \
			       ncclNetDeviceHandle_t **recvDevComm);                            \
	CKM_NCCL_NET_TAIL(VPROPS)                                                                \
	ncclResult_t (*finalize)(void *ctx);                                                    \
	ncclResult_t (*setNetAttr)(void *ctx, ncclNetAttr_t *netAttr);

typedef struct {
	CKM_NCCL_NET_V11_LIKE(ncclNetProperties_v11_t, ncclNetVDeviceProps_v10_t)
} ncclNet_v11_t;

typedef struct {
	CKM_NCCL_NET_V11_LIKE(ncclNetProperties_v12_t, ncclNetVDeviceProps_v12_t)
} ncclNet_v12_t;

/* The documented layout (x86-64 / aarch64 LP64), checked at compile time here and from
 * Python (ctypes) in tests/test_nccl_abi.py. */
_Static_assert(sizeof(ncclNetDeviceHandle_t) == 32, "device handle");
_Static_assert(offsetof(ncclNetProperties_v12_t, vProps) == 64, "props vProps");
_Static_assert(offsetof(ncclNetProperties_v12_t, maxP2pBytes) == 104, "v12 maxP2pBytes");
_Static_assert(offsetof(ncclNetProperties_v12_t, maxMultiRequestSize) == 120, "v12 maxMulti");
_Static_assert(offsetof(ncclNetProperties_v12_t, railId) == 124, "v12 railId");
_Static_assert(offsetof(ncclNetProperties_v12_t, planeId) == 126, "v12 planeId");
_Static_assert(sizeof(ncclNetProperties_v12_t) == 128, "v12 props size");
_Static_assert(offsetof(ncclNetProperties_v11_t, maxP2pBytes) == 88, "v11 maxP2pBytes");
_Static_assert(sizeof(ncclNetProperties_v11_t) == 112, "v11 props size");
_Static_assert(sizeof(ncclNetProperties_v10_t) == 104, "v10 props size");
_Static_assert(sizeof(ncclNetAttr_t) == 44, "net attr size");
_Static_assert(offsetof(ncclNet_v12_t, isend) == 80, "v12 isend slot");
_Static_assert(offsetof(ncclNet_v12_t, finalize) == 160, "v12 finalize slot");
_Static_assert(sizeof(ncclNet_v12_t) == 176, "v12 vtable size");
_Static_assert(sizeof(ncclNet_v11_t) == 176, "v11 vtable size");
_Static_assert(sizeof(ncclNet_v10_t) == 160, "v10 vtable size");

/* ---- the profiler plugin interface (ncclProfiler_v6), the part the identity path uses ---- */
#include <sys/types.h>

#define CKM_PROFILE_COLL (1 << 1)       /* ncclProfileColl */
#define CKM_PROFILE_PROXY_OP (1 << 3)   /* ncclProfileProxyOp */
#define CKM_PROFILE_PROXY_STEP (1 << 4) /* ncclProfileProxyStep */
#define CKM_PROFILE_NET_PLUGIN (1 << 7) /* ncclProfileNetPlugin */
#define CKM_PROFILE_GROUP_API (1 << 8)  /* ncclProfileGroupApi */
#define CKM_PROFILE_COLL_API (1 << 9)   /* ncclProfileCollApi */
#define CKM_PROF_NET_EVENT_START 0      /* ncclProfilerNetEventStart */
#define CKM_PROF_NET_EVENT_STOP 1       /* ncclProfilerNetEventStop */

typedef struct {
	uint64_t type;   /* one ncclProfile* bit */
	void *parentObj; /* the parent event's handle (ours) */
	int rank;
	union {
		struct {
			uint64_t seqNumber;
			const char *func;
			const void *sendBuff;
			void *recvBuff;
			size_t count;
			int root;
			const char *datatype;
			uint8_t nChannels;
			uint8_t nWarps;
			const char *algo;
			const char *proto;
			void *parentGroup;
		} coll;
		struct {
			pid_t pid;
			uint8_t channelId;
			int peer;
			int nSteps;
			int chunkSize;
			int isSend;
		} proxyOp;
		struct {
			int step;
		} proxyStep;
		struct {
			int64_t id;
			void *data;
		} netPlugin;
		char largest[88]; /* the CE collective descriptor, the union's largest member */
	};
} ncclProfilerEventDescr_v6_t;

typedef struct {
	const char *name;
	ncclResult_t (*init)(void **context, uint64_t commId, int *eActivationMask,
			     const char *commName, int nNodes, int nranks, int rank,
			     ncclDebugLogger_t logfn);
	ncclResult_t (*startEvent)(void *context, void **eHandle, ncclProfilerEventDescr_v6_t *eDescr);
	ncclResult_t (*stopEvent)(void *eHandle);
	ncclResult_t (*recordEventState)(void *eHandle, int eState, void *eStateArgs);
	ncclResult_t (*finalize)(void *context);
} ncclProfiler_v6_t;

_Static_assert(sizeof(ncclProfilerEventDescr_v6_t) == 112, "profiler descriptor size");
_Static_assert(offsetof(ncclProfilerEventDescr_v6_t, coll.seqNumber) == 24, "coll.seqNumber");
_Static_assert(offsetof(ncclProfilerEventDescr_v6_t, coll.count) == 56, "coll.count");
_Static_assert(offsetof(ncclProfilerEventDescr_v6_t, coll.datatype) == 72, "coll.datatype");
_Static_assert(offsetof(ncclProfilerEventDescr_v6_t, coll.nChannels) == 80, "coll.nChannels");
_Static_assert(offsetof(ncclProfilerEventDescr_v6_t, coll.algo) == 88, "coll.algo");
_Static_assert(offsetof(ncclProfilerEventDescr_v6_t, coll.proto) == 96, "coll.proto");
_Static_assert(offsetof(ncclProfilerEventDescr_v6_t, proxyOp.channelId) == 28, "op.channelId");
_Static_assert(offsetof(ncclProfilerEventDescr_v6_t, proxyOp.peer) == 32, "op.peer");
_Static_assert(offsetof(ncclProfilerEventDescr_v6_t, proxyOp.nSteps) == 36, "op.nSteps");
_Static_assert(offsetof(ncclProfilerEventDescr_v6_t, proxyOp.isSend) == 44, "op.isSend");
_Static_assert(offsetof(ncclProfilerEventDescr_v6_t, proxyStep.step) == 24, "step.step");
_Static_assert(offsetof(ncclProfilerEventDescr_v6_t, netPlugin.data) == 32, "netPlugin.data");
_Static_assert(sizeof(ncclProfiler_v6_t) == 48, "profiler vtable size");

#endif /* CKM_NCCL_ABI_H */
