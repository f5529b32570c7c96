/* The ckm tuner (ckm_tuner.c): whether it pinned a communicator's allreduces. */
#ifndef CKM_TUNER_H
#define CKM_TUNER_H

#include <stdint.h>

/* 1 when the tuner was initialized for comm_id and pinned every allreduce it was asked
 * about to Ring/Simple on CKM_NCCL_CHANNELS channels; else 0 and *why says why. */
int ckm_tuner_pinned(uint64_t comm_id, const char **why);

#endif
