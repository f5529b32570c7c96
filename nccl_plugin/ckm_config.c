/* Reading and checking the environment, and the plugin's logging: see ckm_config.h. */
#include "ckm_config.h"

#include <arpa/inet.h>
#include <ctype.h>
#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "ckm_crypto.h"
#include "ckm_wire.h"

struct ckm_config g_cfg;
static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static int g_loaded; /* 1 ok, -1 refused */
static char g_err[400];
static ncclDebugLogger_t g_log;

void ckm_set_logger(ncclDebugLogger_t log)
{
	if (log)
		g_log = log;
}

void say(const char *fmt, ...)
{
	char line[512];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(line, sizeof line, fmt, ap);
	va_end(ap);
	fprintf(stderr, "ckm-nccl: %s\n", line);
	if (g_log)
		g_log(NCCL_LOG_WARN, CKM_NCCL_SUBSYS_NET, __FILE__, __LINE__, "ckm-nccl: %s", line);
}

#define FAIL(...) do { snprintf(err, errlen, __VA_ARGS__); return -1; } while (0)

static int get_u64(const char *name, uint64_t dflt, uint64_t lo, uint64_t hi, uint64_t *out,
		   char *err, int errlen)
{
	const char *v = getenv(name);
	if (!v || !*v) {
		*out = dflt;
		return 0;
	}
	char *end;
	errno = 0;
	unsigned long long x = strtoull(v, &end, 10);
	if (errno || *end || x < lo || x > hi || v[0] == '-')
		FAIL("%s=%s: expected an integer in %llu..%llu", name, v, (unsigned long long)lo,
		     (unsigned long long)hi);
	*out = x;
	return 0;
}

/* The first of several variables that is set, else NULL. */
static const char *first_env(const char *a, const char *b)
{
	const char *v = getenv(a);
	return v && *v ? v : getenv(b);
}

static int load_key(struct ckm_config *c, char *err, int errlen)
{
	const char *path = getenv("CHECKMATE_SECRET_FILE");
	if (!path || !*path)
		FAIL("CKM_NCCL_BUCKETS is set but CHECKMATE_SECRET_FILE is not: replicated "
		     "gradients must carry the job's data MAC (docs/security.md)");
	FILE *f = fopen(path, "r");
	if (!f)
		FAIL("cannot read the job secret %s: %s", path, strerror(errno));
	char hex[200] = {0};
	size_t n = fread(hex, 1, sizeof hex - 1, f);
	fclose(f);
	while (n && isspace((unsigned char)hex[n - 1]))
		hex[--n] = 0;
	if (n != 64)
		FAIL("job secret %s must hold 64 hex digits", path);
	uint8_t secret[32], mac[32];
	for (int i = 0; i < 32; i++) {
		unsigned v;
		if (!isxdigit((unsigned char)hex[2 * i]) || !isxdigit((unsigned char)hex[2 * i + 1]) ||
		    sscanf(hex + 2 * i, "%2x", &v) != 1)
			FAIL("job secret %s must hold 64 hex digits", path);
		secret[i] = (uint8_t)v;
	}
	static const char label[] = "checkmate data v1";
	ckm_hmac_sha256(secret, 32, label, sizeof label - 1, mac);
	c->k0 = c->k1 = 0;
	for (int i = 7; i >= 0; i--) {
		c->k0 = (c->k0 << 8) | mac[i];
		c->k1 = (c->k1 << 8) | mac[8 + i];
	}
	return 0;
}

/* NCCL's own variables must pin the schedule the model describes. */
static int check_nccl_env(const struct ckm_config *c, char *err, int errlen)
{
	const char *algo = getenv("NCCL_ALGO"), *proto = getenv("NCCL_PROTO");
	if (!algo || strcasecmp(algo, "Ring") != 0)
		FAIL("CKM_NCCL_BUCKETS needs NCCL_ALGO=Ring (got %s): the schedule model only "
		     "knows the ring", algo ? algo : "unset");
	if (!proto || strcasecmp(proto, "Simple") != 0)
		FAIL("CKM_NCCL_BUCKETS needs NCCL_PROTO=Simple (got %s): the schedule model only "
		     "knows the Simple protocol", proto ? proto : "unset");
	static const char *pin[] = {"NCCL_MIN_NCHANNELS", "NCCL_MAX_NCHANNELS"};
	for (int i = 0; i < 2; i++) {
		const char *v = getenv(pin[i]);
		if (!v || atoi(v) != c->sched.channels)
			FAIL("CKM_NCCL_BUCKETS needs %s=%d (CKM_NCCL_CHANNELS; got %s): NCCL picks "
			     "its channel count per collective otherwise", pin[i], c->sched.channels,
			     v ? v : "unset");
	}
	return 0;
}

static int load_buckets(struct ckm_config *c, const char *list, char *err, int errlen)
{
	const char *p = list;
	c->nbuckets = 0;
	c->total = 0;
	while (*p) {
		char *end;
		errno = 0;
		unsigned long long x = strtoull(p, &end, 10);
		if (errno || end == p || x == 0 || *p == '-' || (*end && *end != ','))
			FAIL("CKM_NCCL_BUCKETS=%s: expected positive element counts separated by commas",
			     list);
		if (c->nbuckets == CKM_MAX_BUCKETS)
			FAIL("CKM_NCCL_BUCKETS lists more than %d buckets", CKM_MAX_BUCKETS);
		c->base[c->nbuckets] = c->total;
		c->bucket[c->nbuckets++] = x;
		c->total += x;
		p = *end ? end + 1 : end;
	}
	if (!c->nbuckets)
		FAIL("CKM_NCCL_BUCKETS is empty");
	return 0;
}

int ckm_config_load(struct ckm_config *c, char *err, int errlen)
{
	uint64_t v;
	memset(c, 0, sizeof *c);
	const char *ip = getenv("CKM_NCCL_IP");
	if (!ip || !*ip)
		ip = "127.0.0.1";
	if (inet_pton(AF_INET, ip, &c->ip) != 1)
		FAIL("CKM_NCCL_IP=%s is not an IPv4 address", ip);
	if (get_u64("CKM_NCCL_PORT_BASE", 47300, CKM_PORT_BASE, CKM_PORT_BASE + CKM_PORT_COUNT - 1,
		    &v, err, errlen))
		return -1;
	c->port_base = (int)v;
	if (get_u64("CKM_NCCL_PORT_COUNT", 512, 1, (uint64_t)(CKM_PORT_BASE + CKM_PORT_COUNT - c->port_base),
		    &v, err, errlen))
		return -1;
	c->port_count = (int)v;
	if (get_u64("CKM_NCCL_TIMEOUT", 300, 1, 86400, &v, err, errlen))
		return -1;
	c->timeout_s = (double)v;
	if (get_u64("CKM_NCCL_JOB", 0, 0, 0xFFFFFFFFu, &v, err, errlen))
		return -1;
	c->job = (uint32_t)v;
	const char *buckets = getenv("CKM_NCCL_BUCKETS");
	if (!buckets || !*buckets)
		return 0; /* plain transport: nothing is tagged */
	c->tagging = 1;
	const char *ident = getenv("CKM_NCCL_IDENTITY");
	if (!ident || !*ident || strcmp(ident, "model") == 0)
		c->identity = CKM_IDENTITY_MODEL;
	else if (strcmp(ident, "profiler") == 0)
		c->identity = CKM_IDENTITY_PROFILER;
	else
		FAIL("CKM_NCCL_IDENTITY=%s: expected model or profiler", ident);
	if (load_buckets(c, buckets, err, errlen))
		return -1;
	const char *rank = first_env("CKM_NCCL_RANK", "RANK");
	const char *world = first_env("CKM_NCCL_NRANKS", "WORLD_SIZE");
	if (!rank || !world)
		FAIL("CKM_NCCL_BUCKETS needs the rank and world size (CKM_NCCL_RANK/RANK and "
		     "CKM_NCCL_NRANKS/WORLD_SIZE)");
	char *e1, *e2;
	long r = strtol(rank, &e1, 10), w = strtol(world, &e2, 10);
	if (*e1 || *e2 || w < 1 || w > 65535 || r < 0 || r >= w)
		FAIL("rank %s of world %s is not a rank of the ring", rank, world);
	c->sched.rank = (int)r;
	c->sched.nranks = (int)w;
	if (get_u64("CKM_NCCL_CHANNELS", 4, 1, 64, &v, err, errlen))
		return -1;
	c->sched.channels = (int)v;
	const char *bs = getenv("NCCL_BUFFSIZE");
	if (!bs || !*bs)
		FAIL("CKM_NCCL_BUCKETS needs NCCL_BUFFSIZE pinned (e.g. 4194304): the chunk size "
		     "follows from it");
	if (get_u64("NCCL_BUFFSIZE", 0, 4096, 1ULL << 34, &v, err, errlen))
		return -1;
	if (v % (CKM_SCHED_STEPS * CKM_SCHED_GRAIN))
		FAIL("NCCL_BUFFSIZE=%llu must be a multiple of %d", (unsigned long long)v,
		     CKM_SCHED_STEPS * CKM_SCHED_GRAIN);
	c->sched.buffsize = v;
	if (check_nccl_env(c, err, errlen))
		return -1;
	if (get_u64("CKM_NCCL_PARTITIONS", 0, 1, 65535, &v, err, errlen))
		return -1;
	if (v == 0)
		FAIL("CKM_NCCL_BUCKETS needs CKM_NCCL_PARTITIONS (the number of shadows)");
	c->partitions = (int)v;
	if (get_u64("CKM_NCCL_ITERATION", 1, 1, UINT64_MAX / 2, &v, err, errlen))
		return -1;
	c->first_iteration = v;
	if (!getenv("CKM_NCCL_JOB"))
		FAIL("CKM_NCCL_BUCKETS needs CKM_NCCL_JOB (the job id the switch entries match)");
	if (get_u64("CKM_NCCL_REPAIR_KEEP", 8, 0, 1024, &c->repair_keep, err, errlen))
		return -1;
	if (get_u64("CKM_NCCL_REPAIR_MB", 1024, 1, 1 << 20, &v, err, errlen))
		return -1;
	c->repair_bytes = v << 20;
	if (get_u64("CKM_NCCL_REPAIR_PORT", CKM_PORT_BASE + 2, 1, 65535, &v, err, errlen))
		return -1;
	c->repair_port = (int)v;
	return load_key(c, err, errlen);
}

ncclResult_t load_config(void)
{
	pthread_mutex_lock(&g_lock);
	if (!g_loaded)
		g_loaded = ckm_config_load(&g_cfg, g_err, sizeof g_err) ? -1 : 1;
	int ok = g_loaded;
	pthread_mutex_unlock(&g_lock);
	if (ok < 0) {
		say("refusing to start: %s", g_err);
		return ncclInvalidUsage;
	}
	return ncclSuccess;
}

int ckm_comm_selected(int index)
{
	const char *which = getenv("CKM_NCCL_COMM");
	return g_cfg.tagging && index == (which && *which ? atoi(which) : 0);
}

ncclResult_t ckm_comm_begin(int *counter, int *index, int *selected)
{
	ncclResult_t r = load_config();
	if (r)
		return r;
	*index = __atomic_fetch_add(counter, 1, __ATOMIC_RELAXED);
	*selected = ckm_comm_selected(*index);
	return ncclSuccess;
}
