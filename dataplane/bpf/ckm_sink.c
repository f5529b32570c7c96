/* A "shadow sink": tc ingress program on a shadow host's interface (inside the shadow's
 * namespace) that counts the shadow copies arriving there and, in drop mode, discards them
 * before the IP stack.
 *
 * Why: on a real deployment the shadow is another machine, so receiving a copy costs the
 * shadow's CPU, not the switch's or the trainers'. In the namespace testbed every host shares
 * the same cores, so a copy delivered to a real socket charges a second full receive to the
 * machine under test. The dataplane bench puts this sink on the shadow's interface to
 * measure what replication costs the switch alone, while still checking that every copy
 * arrives and is addressed and stamped as the replication entry says.
 *
 * Only UDP datagrams to a ckm port are counted (and dropped); ARP and everything else passes.
 * A copy counts as "ok" when its ckm header is well formed, REPLICATE is set, epoch and token
 * are the expected ones, the destination IPv4/UDP port are the shadow's, and the IPv4
 * header checksum verifies. The UDP checksum is not recomputed here (that would cost a pass
 * over the payload); in pass mode the kernel's UDP layer checks it before the socket.
 * Maps are pinned by the loader (dataplane/sink.py); layouts are mirrored there.
 */
#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/pkt_cls.h>
#include <linux/udp.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_helpers.h>

#include "ckm_wire.h"

struct sink_cfg {
	__u32 epoch;      /* expected epoch, host order */
	__u32 token;      /* expected token, host order */
	__be32 ip;        /* the shadow's IPv4 */
	__be16 port;      /* the shadow's UDP port */
	__u8 drop;        /* 1: drop counted datagrams here; 0: pass them to the IP stack */
	__u8 pad;
};

struct sink_stats {
	__u64 packets;    /* ckm-port UDP datagrams seen */
	__u64 bytes;      /* their frame bytes */
	__u64 ok;         /* of those, copies that match the expected addressing and session */
	__u64 dropped;    /* of those, discarded here (drop mode) */
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct sink_cfg);
} ckm_sink_cfg SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct sink_stats);
} ckm_sink_stats SEC(".maps");

static __always_inline int ip_csum_ok(struct iphdr *ip)
{
	__s64 sum;

	if (ip->ihl != 5) /* options: leave it to the stack */
		return 1;
	sum = bpf_csum_diff(0, 0, (__be32 *)ip, sizeof(*ip), 0);
	if (sum < 0)
		return 0;
	sum = (sum & 0xffff) + (sum >> 16);
	sum = (sum & 0xffff) + (sum >> 16);
	return sum == 0xffff;
}

SEC("tc")
int ckm_sink(struct __sk_buff *skb)
{
	__u32 zero = 0;
	struct sink_cfg *cfg = bpf_map_lookup_elem(&ckm_sink_cfg, &zero);
	struct sink_stats *st = bpf_map_lookup_elem(&ckm_sink_stats, &zero);
	struct ethhdr eth;
	struct iphdr ip;
	struct udphdr udp;
	struct ckm_hdr h;
	__u32 udp_off;
	__u16 dport;
	int ok;

	if (!cfg || !st)
		return TC_ACT_OK;
	if (bpf_skb_load_bytes(skb, 0, &eth, sizeof(eth)) < 0 ||
	    eth.h_proto != bpf_htons(ETH_P_IP))
		return TC_ACT_OK;
	if (bpf_skb_load_bytes(skb, sizeof(eth), &ip, sizeof(ip)) < 0 ||
	    ip.ihl < 5 || ip.protocol != IPPROTO_UDP || (ip.frag_off & bpf_htons(0x3fff)))
		return TC_ACT_OK;
	udp_off = sizeof(eth) + ip.ihl * 4;
	if (bpf_skb_load_bytes(skb, udp_off, &udp, sizeof(udp)) < 0)
		return TC_ACT_OK;
	dport = bpf_ntohs(udp.dest);
	if (dport < CKM_PORT_BASE || dport >= CKM_PORT_BASE + CKM_PORT_COUNT)
		return TC_ACT_OK;

	__sync_fetch_and_add(&st->packets, 1);
	__sync_fetch_and_add(&st->bytes, skb->len);
	ok = bpf_skb_load_bytes(skb, udp_off + sizeof(udp), &h, sizeof(h)) == 0 &&
	     h.magic == bpf_htons(CKM_MAGIC) && h.version == CKM_VERSION &&
	     (h.flags & CKM_F_REPLICATE) && bpf_ntohl(h.epoch) == cfg->epoch &&
	     bpf_ntohl(h.token) == cfg->token && ip.daddr == cfg->ip && udp.dest == cfg->port &&
	     ip_csum_ok(&ip);
	if (ok)
		__sync_fetch_and_add(&st->ok, 1);
	if (cfg->drop) {
		__sync_fetch_and_add(&st->dropped, 1);
		return TC_ACT_SHOT;
	}
	return TC_ACT_OK;
}

char _license[] SEC("license") = "GPL";
