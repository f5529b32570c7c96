/* Prints the plugin's schedule (ckm_sched.c) for tests/test_nccl_schedule.py, which compares
 * it with checkmate.testbed.nccl_release (NCCL's source in Python). Not part of the plugin.
 * stdin: lines "release nranks rank channels buffsize count"; stdout per line: "C n" (used
 * channels, profiler chunk), then per channel "ch sends", then "offset count final" each. */
#include <stdio.h>

#include "../ckm_sched.h"

int main(void)
{
	struct ckm_sched s;
	unsigned long long buff, count;
	while (scanf("%d %d %d %d %llu %llu", &s.release, &s.nranks, &s.rank, &s.channels, &buff,
		     &count) == 6) {
		s.buffsize = buff;
		printf("C %d %llu\n", ckm_sched_nchannels(&s, count),
		       (unsigned long long)ckm_sched_prof_chunk(&s));
		for (int ch = 0; ch < s.channels; ch++) {
			unsigned long long n = ckm_sched_sends(&s, count, ch);
			printf("%d %llu\n", ch, n);
			for (unsigned long long i = 0; i < n; i++) {
				struct ckm_slice sl;
				ckm_sched_slice(&s, count, ch, i, &sl);
				printf("%llu %llu %d\n", (unsigned long long)sl.offset,
				       (unsigned long long)sl.count, sl.final);
			}
		}
	}
	return 0;
}
