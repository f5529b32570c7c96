/* The plugin's settings, read once from the environment (docs/nccl_plugin.md, "Settings"),
 * and its one-line logging. A setting that would make the schedule model wrong is refused
 * with one error line. This unit owns the settings every other part reads (g_cfg), their
 * loading and `say`: the net, profiler, tuner and repair parts depend on it, never on each
 * other's globals. All hidden (the library exports only NCCL's symbols). */
#ifndef CKM_CONFIG_H
#define CKM_CONFIG_H

#include <stdint.h>
#include <netinet/in.h>

#include "ckm_nccl_abi.h"
#include "ckm_sched.h"

#define CKM_MAX_BUCKETS 4096
#define CKM_IDENTITY_MODEL 0    /* the ring-schedule model alone */
#define CKM_IDENTITY_PROFILER 1 /* each isend's profiler step handle */

struct ckm_config {
	struct in_addr ip;     /* CKM_NCCL_IP: address to bind and advertise */
	int port_base, port_count;
	double timeout_s;      /* CKM_NCCL_TIMEOUT: no acknowledgement for this long = error */
	uint32_t job;          /* CKM_NCCL_JOB */
	/* Tagging (on when CKM_NCCL_BUCKETS is set). */
	int tagging;
	int identity;          /* CKM_NCCL_IDENTITY: model (default) or profiler */
	struct ckm_sched sched;
	int nbuckets;
	uint64_t bucket[CKM_MAX_BUCKETS], base[CKM_MAX_BUCKETS], total;
	int partitions;
	uint64_t first_iteration;
	uint64_t k0, k1;       /* data MAC key: an input (today from CHECKMATE_SECRET_FILE) */
	/* Repair (ckm_repair.c): iterations of REPLICATE pieces kept (0: none), bytes, port */
	uint64_t repair_keep, repair_bytes;
	int repair_port;
};

/* The process's settings: valid once load_config returned ncclSuccess. */
extern struct ckm_config g_cfg;

/* 0 on success; otherwise writes one line saying why into err. */
int ckm_config_load(struct ckm_config *c, char *err, int errlen);
/* Reads the environment into g_cfg once per process (any plugin's init may be first);
 * ncclInvalidUsage and one line when refused. */
ncclResult_t load_config(void);
/* 1 when tagging is on and the index-th communicator (in init order) is the one
 * CKM_NCCL_COMM selects (default 0). */
int ckm_comm_selected(int index);
/* Where each per-communicator init (net, profiler) starts: loads the settings (once per
 * process), numbers the communicator in the order of that plugin's init calls (*counter)
 * and says whether it is the one CKM_NCCL_COMM selects. */
ncclResult_t ckm_comm_begin(int *counter, int *index, int *selected);

/* NCCL's logger from the net plugin's init (NULL until then; NULL keeps the one we have). */
void ckm_set_logger(ncclDebugLogger_t log);
/* One clear line on stderr ("ckm-nccl: ...") and in NCCL's log. */
void say(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

#endif
