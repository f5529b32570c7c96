/* The plugin's settings, read once from the environment (docs/nccl_plugin.md, "Settings").
 * A setting that would make the schedule model wrong is refused with one error line. */
#ifndef CKM_CONFIG_H
#define CKM_CONFIG_H

#include <stdint.h>
#include <netinet/in.h>

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

/* 0 on success; otherwise writes one line saying why into err. */
int ckm_config_load(struct ckm_config *c, char *err, int errlen);

#endif
