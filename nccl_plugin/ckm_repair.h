/* Repair on the NCCL path (docs/nccl_plugin.md, "Repair"): the REPLICATE pieces this rank
 * sent are kept, bounded, for the last CKM_NCCL_REPAIR_KEEP iterations, and a thread answers
 * shadows' repair requests (checkmate/protocol/repair.py) from them exactly as a Python
 * trainer does (checkmate/train/repair.py): a lost or damaged copy is sent again instead of
 * costing a re-seed. */
#ifndef CKM_REPAIR_H
#define CKM_REPAIR_H

#include <stdint.h>

/* Starts the service once per process (tagging on); one line and no repair if it cannot. */
void ckm_repair_start(void);
/* Keeps a copy of one REPLICATE piece (count float32 at data). */
void ckm_repair_retain(uint64_t iteration, uint64_t offset, uint32_t count, uint16_t partition,
		       uint16_t bucket, const void *data);

#endif
