/* What the plugin's parts share: the settings, one-line error reporting, config loading,
 * and NCCL's logger. All hidden (the library exports only NCCL's symbols). */
#ifndef CKM_PLUGIN_H
#define CKM_PLUGIN_H

#include "ckm_config.h"
#include "ckm_nccl_abi.h"

extern struct ckm_config g_cfg;
/* One clear line on stderr ("ckm-nccl: ...") and in NCCL's log. */
void say(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* Reads the environment once per process; ncclInvalidUsage (and one line) when refused. */
ncclResult_t load_config(void);

#endif
