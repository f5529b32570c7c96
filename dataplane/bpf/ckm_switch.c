/* SPDX-License-Identifier: GPL-2.0 */
/* The Checkmate switch as tc (clsact, direct-action) eBPF programs.
 *
 * A Linux bridge in the switch namespace does plain L2 forwarding between the veth ports.
 * These programs sit on every port:
 *
 *   ckm_ingress (frames entering the switch from a host): counts rx; drops and counts every
 *     frame whose source is not the one the controller bound to the port (ckm_bind: the
 *     host's MAC and IPv4 address; an IPv4 frame's source address, an ARP frame's sender
 *     addresses; any other ethertype has no source this switch can check and is dropped
 *     too), so no host can take another's addresses, and the bridge, which does not learn
 *     (its entries are static, programmed from the config), never moves an entry. For a
 *     well-formed
 *     ckm datagram with REPLICATE whose (job, src IP, dst IP, partition) has a replication
 *     entry, and which entered through the port of the host that owns its source address
 *     (the entry's in_ifindex), sends exactly one copy to the entry's shadow port with the
 *     addressing rewritten, then restores the original, which the bridge forwards unchanged.
 *     A datagram from another port (a spoofed source) or one whose count disagrees with its
 *     length is forwarded plainly and counted, never copied or stamped.
 *     Every well-formed ckm datagram entering is also counted per port and DSCP (ckm_dscp):
 *     hosts mark the ckm class with DSCP 24 (docs/pfc.md), and these counts show whether
 *     they do.
 *   ckm_egress (frames leaving the switch towards a host): counts tx and applies the port's
 *     fault knobs (drop / corrupt probability, optionally only inside an iteration window)
 *     to ckm-port UDP datagrams, shadow copies included, and to IPv4/UDP fragments: the
 *     first fragment is checked for a ckm port, later ones carry no UDP header and count
 *     as ckm traffic (the testbed carries no other fragmented UDP). All fragments of one
 *     datagram share one fate, so a knob's probability is a per-datagram loss rate.
 *
 * Maps are pinned by the loader under /sys/fs/bpf/<prefix>-<switch>/maps/; layouts are
 * mirrored in dataplane/maps.py (ckm_fault_win and ckm_fault_st: dataplane/switch.py).
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

#define MAX_ENTRIES 4096
#define MAX_PORTS 256
/* Shadows per partition a datagram is copied to (checkmate/config/schema.py's
 * MAX_REPLICAS; tests/test_dataplane.py checks they agree). */
#define CKM_MAX_REPLICAS 3

struct repl_key {
	__u32 job_id;    /* host order */
	__be32 src_ip;
	__be32 dst_ip;
	__u16 partition; /* host order */
	__u16 replica;   /* which of the partition's shadows: 0 .. CKM_MAX_REPLICAS - 1 */
};

struct repl_val {
	__u32 ifindex;    /* switch port leading to the shadow */
	__u32 in_ifindex; /* switch port of the host that owns src_ip: the only port whose
			   * datagrams are copied (a copy is stamped with the shadow's valid
			   * epoch/token: a spoofed source must not get one accepted) */
	__u8 mac[6];      /* shadow MAC */
	__be16 port;      /* shadow UDP port */
	__be32 ip;        /* shadow IPv4 */
	__u32 epoch;      /* host order, written big-endian into the copy */
	__u32 token;
	__u32 pad;
	__u64 packets;    /* copies sent */
	__u64 bytes;
};

struct port_stats {
	__u64 rx;
	__u64 tx;
	__u64 replicated; /* copies made from frames that entered here */
	__u64 dropped;    /* fault drops on egress (frames: each IP fragment counts), and copies
			   * the kernel refused */
	__u64 corrupted;  /* datagrams corrupted on egress */
	__u64 malformed;  /* ckm-port UDP whose ckm header is short, has bad magic/version or
			   * an unknown dtype, or whose count disagrees with its length */
	__u64 no_entry;   /* REPLICATE without a matching replication entry */
	__u64 spoofed;    /* REPLICATE matching an entry but entering through another port
			   * than its source host's: forwarded, not copied (with the source
			   * binding below, only a binding that disagrees with the entries) */
	__u64 bad_src_mac; /* frames dropped: source MAC (or ARP sender MAC) not the port's
			    * bound MAC, or the port has no binding */
	__u64 bad_src_ip;  /* frames dropped: IPv4 source (or ARP sender IP) not the port's
			    * bound address, a header too short to tell, or no IPv4/ARP */
};

/* The one host a port leads to, written by the control plane (dataplane/switch.py
 * bind_ports): every frame entering the port must come from these addresses. */
struct port_bind {
	__u8 mac[6];
	__u16 pad;
	__be32 ip;
};

struct fault {
	__u64 drop;       /* probability * 2^32; compared with bpf_get_prandom_u32() */
	__u64 corrupt;
	__u64 swap;       /* a gradient's payload rewritten under its CRC32C (see swap()) */
};

/* Which iterations a port's knobs hit; written by the control plane with every knob. */
struct fault_win {
	__u64 from_iter;  /* first iteration hit; 0: no lower bound */
	__u64 until_iter; /* last iteration hit (inclusive); 0: no upper bound */
	__u64 seed;       /* fresh per setting: salts the per-datagram fragment draw and tells
			   * ckm_egress that last_iter predates this setting */
};

/* Per-port fault state, written by ckm_egress only. */
struct fault_state {
	__u64 last_iter;      /* latest nonzero ckm iteration seen leaving the port while a knob
			       * was set: the iteration of frames that carry none */
	__u64 seed;           /* fault_win.seed that last_iter belongs to */
	__u64 frag_dropped;   /* the IPv4 fragments among ckm_ports.dropped */
	__u64 frag_corrupted; /* fragmented datagrams among ckm_ports.corrupted */
	__u64 swapped;        /* gradient datagrams whose payload swap() rewrote */
};

struct sw_cfg {
	__u8 mac[6];      /* the switch's MAC: source of every shadow copy */
	__u16 pad;
};

/* Well-formed ckm datagrams that entered a port, by their IPv4 DSCP. */
struct dscp_key {
	__u32 ifindex;
	__u32 dscp;
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, MAX_ENTRIES);
	__type(key, struct repl_key);
	__type(value, struct repl_val);
} ckm_repl SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, MAX_PORTS);
	__type(key, __u32);
	__type(value, struct port_stats);
} ckm_ports SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, MAX_PORTS);
	__type(key, __u32);
	__type(value, struct fault);
} ckm_fault SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, MAX_PORTS);
	__type(key, __u32);
	__type(value, struct port_bind);
} ckm_bind SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, MAX_PORTS);
	__type(key, __u32);
	__type(value, struct fault_win);
} ckm_fault_win SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, MAX_PORTS);
	__type(key, __u32);
	__type(value, struct fault_state);
} ckm_fault_st SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct sw_cfg);
} ckm_cfg SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, MAX_PORTS * 64);
	__type(key, struct dscp_key);
	__type(value, __u64);
} ckm_dscp SEC(".maps");

/* Offsets of a ckm-port IPv4/UDP datagram; filled by parse_ip() and parse_ckm_udp(). */
struct pkt {
	__u32 ip_off;
	__u32 udp_off;
	__u32 ckm_off;
	__u32 udp_len;    /* UDP header + payload, from the UDP header; 0 when inconsistent
			   * (always for a first fragment, whose datagram is longer than it) */
	struct iphdr ip;
	struct udphdr udp;
};

#define IP_MF_OFFSET 0x3fff /* frag_off bits: more fragments, fragment offset */
#define IP_OFFSET 0x1fff

/* 0: an IPv4/UDP frame (a fragment, too) with p->ip and p->udp_off set; -1: anything else.
 * An 802.1Q-tagged frame needs no case here: the receive path moves the tag into the skb's
 * metadata (skb->vlan_tci) before tc ingress runs, and the bridge keeps it for egress
 * (tests/test_dataplane.py sends priority-tagged ckm through the switch). */
static __always_inline int parse_ip(struct __sk_buff *skb, struct pkt *p)
{
	struct ethhdr eth;

	if (bpf_skb_load_bytes(skb, 0, &eth, sizeof(eth)) < 0)
		return -1;
	if (eth.h_proto != bpf_htons(ETH_P_IP))
		return -1;
	p->ip_off = sizeof(eth);
	if (bpf_skb_load_bytes(skb, p->ip_off, &p->ip, sizeof(p->ip)) < 0)
		return -1;
	if (p->ip.ihl < 5 || p->ip.protocol != IPPROTO_UDP)
		return -1;
	p->udp_off = p->ip_off + p->ip.ihl * 4;
	return 0;
}

/* After parse_ip() of a frame that starts a datagram: 0 when its UDP destination is a ckm
 * port (p->udp, ckm_off, udp_len set), -1 otherwise. */
static __always_inline int parse_ckm_udp(struct __sk_buff *skb, struct pkt *p)
{
	if (bpf_skb_load_bytes(skb, p->udp_off, &p->udp, sizeof(p->udp)) < 0)
		return -1;
	__u16 dport = bpf_ntohs(p->udp.dest);
	if (dport < CKM_PORT_BASE || dport >= CKM_PORT_BASE + CKM_PORT_COUNT)
		return -1;
	p->ckm_off = p->udp_off + sizeof(struct udphdr);
	p->udp_len = bpf_ntohs(p->udp.len);
	if (p->udp_len < sizeof(struct udphdr) || p->udp_off + p->udp_len > skb->len)
		p->udp_len = 0; /* inconsistent length: treated as too short below */
	return 0;
}

/* 0: an unfragmented IPv4/UDP datagram to a ckm port; -1: anything else. */
static __always_inline int parse_udp(struct __sk_buff *skb, struct pkt *p)
{
	if (parse_ip(skb, p) < 0)
		return -1;
	if (p->ip.frag_off & bpf_htons(IP_MF_OFFSET))
		return -1;
	return parse_ckm_udp(skb, p);
}

/* 1 when the datagram is exactly as long as its header says: the UDP payload is the header
 * and count elements of a known dtype (docs/protocol.md). p->udp_len is bounded by the frame
 * (parse_ckm_udp) and at least UDP header + CKM_HEADER_LEN (checked by the caller). */
static __always_inline int length_ok(const struct pkt *p, const struct ckm_hdr *h)
{
	__u64 size, want;

	if (h->dtype == CKM_DT_FLOAT32)
		size = CKM_DT_FLOAT32_SIZE;
	else if (h->dtype == CKM_DT_BFLOAT16)
		size = CKM_DT_BFLOAT16_SIZE;
	else if (h->dtype == CKM_DT_FLOAT16)
		size = CKM_DT_FLOAT16_SIZE;
	else if (h->dtype == CKM_DT_BYTES)
		size = CKM_DT_BYTES_SIZE;
	else
		return 0;
	want = (__u64)bpf_ntohl(h->count) * size; /* 64-bit: a huge count cannot wrap */
	return want == p->udp_len - sizeof(struct udphdr) - CKM_HEADER_LEN;
}

static __always_inline void count(__u64 *field)
{
	__sync_fetch_and_add(field, 1);
}

static __always_inline void count_dscp(__u32 ifindex, const struct iphdr *ip)
{
	struct dscp_key k = {.ifindex = ifindex, .dscp = ip->tos >> 2};
	__u64 one = 1, *c = bpf_map_lookup_elem(&ckm_dscp, &k);

	if (c) {
		count(c);
		return;
	}
	if (bpf_map_update_elem(&ckm_dscp, &k, &one, BPF_NOEXIST) < 0) {
		c = bpf_map_lookup_elem(&ckm_dscp, &k); /* another CPU inserted it first */
		if (c)
			count(c);
	}
}

#define CSUM_UDP(sz) (BPF_F_MARK_MANGLED_0 | (sz))
#define STORE_F BPF_F_RECOMPUTE_CSUM

/* Rewrite addressing to the shadow's, clone the frame out of the shadow port, then put the
 * saved original bytes back (checksum fields included, so the original stays bit-exact). */
static __always_inline int replicate(struct __sk_buff *skb, struct pkt *p, struct ckm_hdr *h,
				     struct repl_val *v)
{
	__u32 zero = 0;
	struct sw_cfg *cfg = bpf_map_lookup_elem(&ckm_cfg, &zero);
	__u8 old_eth[12], new_eth[12];
	__u32 csum_ip = p->ip_off + 10, csum_udp = p->udp_off + 6;
	__be16 old_ip_csum = p->ip.check, old_udp_csum = p->udp.check;
	__be32 old_daddr = p->ip.daddr, new_epoch = bpf_htonl(v->epoch), new_token =
		bpf_htonl(v->token);
	__be16 old_dport = p->udp.dest;
	__be32 old_et[2] = {h->epoch, h->token};
	int ret;

	if (!cfg)
		return -1;
	if (bpf_skb_load_bytes(skb, 0, old_eth, sizeof(old_eth)) < 0)
		return -1;
	__builtin_memcpy(new_eth, v->mac, 6);
	__builtin_memcpy(new_eth + 6, cfg->mac, 6);

	if (bpf_skb_store_bytes(skb, 0, new_eth, sizeof(new_eth), STORE_F) < 0)
		return -1;
	bpf_l3_csum_replace(skb, csum_ip, old_daddr, v->ip, 4);
	bpf_l4_csum_replace(skb, csum_udp, old_daddr, v->ip, BPF_F_PSEUDO_HDR | CSUM_UDP(4));
	bpf_skb_store_bytes(skb, p->ip_off + 16, &v->ip, 4, STORE_F);
	bpf_l4_csum_replace(skb, csum_udp, old_dport, v->port, CSUM_UDP(2));
	bpf_skb_store_bytes(skb, p->udp_off + 2, &v->port, 2, STORE_F);
	bpf_l4_csum_replace(skb, csum_udp, h->epoch, new_epoch, CSUM_UDP(4));
	bpf_skb_store_bytes(skb, p->ckm_off + 8, &new_epoch, 4, STORE_F);
	bpf_l4_csum_replace(skb, csum_udp, h->token, new_token, CSUM_UDP(4));
	bpf_skb_store_bytes(skb, p->ckm_off + 12, &new_token, 4, STORE_F);

	ret = bpf_clone_redirect(skb, v->ifindex, 0);

	bpf_skb_store_bytes(skb, 0, old_eth, sizeof(old_eth), STORE_F);
	bpf_skb_store_bytes(skb, csum_ip, &old_ip_csum, 2, STORE_F);
	bpf_skb_store_bytes(skb, p->ip_off + 16, &old_daddr, 4, STORE_F);
	bpf_skb_store_bytes(skb, p->udp_off + 2, &old_dport, 2, STORE_F);
	bpf_skb_store_bytes(skb, csum_udp, &old_udp_csum, 2, STORE_F);
	bpf_skb_store_bytes(skb, p->ckm_off + 8, old_et, sizeof(old_et), STORE_F);
	return ret;
}

static __always_inline int mac_eq(const __u8 *a, const __u8 *b)
{
	return a[0] == b[0] && a[1] == b[1] && a[2] == b[2] && a[3] == b[3] && a[4] == b[4] &&
	       a[5] == b[5];
}

/* ARP for Ethernet/IPv4 up to the sender's addresses (RFC 826; linux/if_arp.h's arphdr,
 * which cannot be included in a BPF build, pulls in libc headers). */
struct arp_eth {
	__be16 ar_hrd;
	__be16 ar_pro;
	__u8 ar_hln;
	__u8 ar_pln;
	__be16 ar_op;
	__u8 sha[6];
	__be32 spa;
} __attribute__((packed));

/* 1 when the frame's source addresses are the ones bound to its ingress port; otherwise
 * counts why and returns 0 (the caller drops it). Runs before anything else looks at the
 * frame: a frame that fails never reaches the bridge, the replication table or a shadow. */
static __always_inline int source_ok(struct __sk_buff *skb, __u32 ifindex, struct port_stats *ps)
{
	struct port_bind *b = bpf_map_lookup_elem(&ckm_bind, &ifindex);
	struct ethhdr eth;

	if (!b || bpf_skb_load_bytes(skb, 0, &eth, sizeof(eth)) < 0 ||
	    !mac_eq(eth.h_source, b->mac)) {
		count(&ps->bad_src_mac);
		return 0;
	}
	if (eth.h_proto == bpf_htons(ETH_P_IP)) {
		struct iphdr ip;

		if (bpf_skb_load_bytes(skb, sizeof(eth), &ip, sizeof(ip)) < 0 ||
		    ip.saddr != b->ip) {
			count(&ps->bad_src_ip);
			return 0;
		}
		return 1;
	}
	if (eth.h_proto == bpf_htons(ETH_P_ARP)) {
		struct arp_eth arp;

		if (bpf_skb_load_bytes(skb, sizeof(eth), &arp, sizeof(arp)) < 0 ||
		    arp.ar_hln != 6 || arp.ar_pln != 4) {
			count(&ps->bad_src_ip);
			return 0;
		}
		if (!mac_eq(arp.sha, b->mac)) {
			count(&ps->bad_src_mac);
			return 0;
		}
		if (arp.spa != b->ip) {
			count(&ps->bad_src_ip);
			return 0;
		}
		return 1;
	}
	count(&ps->bad_src_ip); /* IPv6, a second VLAN tag, ...: no bound source to check */
	return 0;
}

SEC("tc")
int ckm_ingress(struct __sk_buff *skb)
{
	__u32 ifindex = skb->ifindex;
	struct port_stats *ps = bpf_map_lookup_elem(&ckm_ports, &ifindex);
	struct ckm_hdr h;
	struct pkt p;

	if (!ps)
		return TC_ACT_OK; /* not one of our ports: stay out of the way */
	count(&ps->rx);
	if (!source_ok(skb, ifindex, ps))
		return TC_ACT_SHOT;
	if (parse_udp(skb, &p) < 0)
		return TC_ACT_OK;
	if (p.udp_len < sizeof(struct udphdr) + CKM_HEADER_LEN ||
	    bpf_skb_load_bytes(skb, p.ckm_off, &h, sizeof(h)) < 0 ||
	    h.magic != bpf_htons(CKM_MAGIC) || h.version != CKM_VERSION || !length_ok(&p, &h)) {
		count(&ps->malformed);
		return TC_ACT_OK;
	}
	count_dscp(ifindex, &p.ip);
	if (!(h.flags & CKM_F_REPLICATE))
		return TC_ACT_OK;

	struct repl_key key = {
		.job_id = bpf_ntohl(h.job_id),
		.src_ip = p.ip.saddr,
		.dst_ip = p.ip.daddr,
		.partition = bpf_ntohs(h.partition),
	};
	/* One copy per shadow of the partition: replica 0's entry, then the next ones while
	 * they exist (the controller numbers a partition's replicas from 0 without gaps). */
	for (int r = 0; r < CKM_MAX_REPLICAS; r++) {
		struct repl_val *v;

		key.replica = r;
		v = bpf_map_lookup_elem(&ckm_repl, &key);
		if (!v) {
			if (r == 0)
				count(&ps->no_entry);
			return TC_ACT_OK;
		}
		if (v->in_ifindex != ifindex) {
			count(&ps->spoofed); /* source address of another port's host */
			return TC_ACT_OK;
		}
		if (replicate(skb, &p, &h, v) < 0) {
			count(&ps->dropped);
			continue;
		}
		count(&ps->replicated);
		__sync_fetch_and_add(&v->packets, 1);
		__sync_fetch_and_add(&v->bytes, skb->len);
	}
	return TC_ACT_OK;
}

/* The ckm iteration (host order) of the datagram parsed into p, 0 when it carries none:
 * ring ACKs, handshakes, and ckm-port datagrams whose header is short or not ckm. A first
 * fragment's UDP length is the whole datagram's, so there only the frame bounds the load. */
static __always_inline __u64 ckm_iteration(struct __sk_buff *skb, struct pkt *p, int frag)
{
	struct ckm_hdr h;

	if (!frag && p->udp_len < sizeof(struct udphdr) + CKM_HEADER_LEN)
		return 0;
	if (bpf_skb_load_bytes(skb, p->ckm_off, &h, sizeof(h)) < 0)
		return 0;
	if (h.magic != bpf_htons(CKM_MAGIC) || h.version != CKM_VERSION)
		return 0;
	return bpf_be64_to_cpu(h.iteration);
}

/* A 64-bit finalizer (xor-shift / multiply rounds) that spreads every input bit over the
 * output: consecutive IP ids must give independent-looking draws. */
static __always_inline __u64 mix64(__u64 x)
{
	x ^= x >> 33;
	x *= 0xff51afd7ed558ccdULL;
	x ^= x >> 33;
	x *= 0xc4ceb9fe1a85ec53ULL;
	x ^= x >> 33;
	return x;
}

/* One draw shared by every fragment of a datagram (same source, destination and IP id), so
 * its fragments are dropped together: a 30% knob loses 30% of the datagrams, not 1 - 0.7^8
 * of 8-fragment ones. High half: the drop draw; low half: the corrupt draw. */
static __always_inline __u64 frag_draw(const struct iphdr *ip, __u64 seed)
{
	__u64 x = mix64(seed ^ (((__u64)ip->saddr << 32) | ip->daddr));

	return mix64(x ^ ip->id);
}

/* Where the datagram's bytes in this frame end: the fragment's end for a first fragment,
 * the UDP length's otherwise (-1 when that length is inconsistent: leave the frame alone). */
static __always_inline int payload_end(struct __sk_buff *skb, struct pkt *p, int frag,
				       __u32 *end)
{
	if (frag) {
		*end = p->ip_off + bpf_ntohs(p->ip.tot_len);
		if (*end > skb->len)
			*end = skb->len;
		return 0;
	}
	if (p->udp_len < sizeof(struct udphdr))
		return -1;
	*end = p->udp_off + p->udp_len;
	return 0;
}

/* Flip one 16-bit word of the UDP payload (past the ckm header when there is payload, so the
 * CRC32C fails) and fix the UDP checksum, so the receiver's kernel still delivers it. For a
 * first fragment the payload ends with the fragment; the word sits at an even offset from
 * the UDP header and the checksum covers the whole reassembled datagram, so the same
 * incremental fix-up holds and the reassembled datagram passes the UDP checksum too. */
static __always_inline int corrupt(struct __sk_buff *skb, struct pkt *p, int frag)
{
	__u32 end, plen, start = p->ckm_off, words;
	__be16 w, nw;

	if (payload_end(skb, p, frag, &end) < 0 || end < start)
		return -1;
	plen = end - start;
	if (plen >= CKM_HEADER_LEN + 2) {
		start += CKM_HEADER_LEN;
		plen -= CKM_HEADER_LEN;
	} else if (plen >= CKM_HEADER_LEN) {
		start += 52; /* no payload: hit the crc32c field instead */
		plen = 4;
	}
	words = plen / 2;
	if (!words)
		return -1;
	start += 2 * (bpf_get_prandom_u32() % words);
	if (bpf_skb_load_bytes(skb, start, &w, 2) < 0)
		return -1;
	nw = w ^ 0xffff;
	bpf_l4_csum_replace(skb, p->udp_off + 6, w, nw, CSUM_UDP(2));
	return bpf_skb_store_bytes(skb, start, &nw, 2, STORE_F);
}

/* The on-path attack docs/security.md names: a gradient's payload changed so that its
 * CRC32C, and with it the datagram's tag, still match. The CRC is linear over GF(2), so
 * XOR-ing any multiple of its generator polynomial leaves it as it was; these 6 bytes (3
 * words) are one, found by solving the CRC's linear map (tests/test_dataplane.py checks
 * it against crc32c and this file). Only REPLICATE datagrams without
 * CONTROL, with at least 6 payload bytes in this frame, are rewritten (a control message has
 * its own MAC over every byte); the UDP checksum is fixed word by word. */
#define SWAP_WORDS 3
static __always_inline int swap(struct __sk_buff *skb, struct pkt *p, int frag)
{
	const __u8 pattern[2 * SWAP_WORDS] = {0xf1, 0x76, 0xec, 0x05, 0x01, 0x00};
	__u32 end, start = p->ckm_off, words;
	__u8 flags;
	int i;

	if (payload_end(skb, p, frag, &end) < 0)
		return -1;
	if (bpf_skb_load_bytes(skb, start + 3, &flags, 1) < 0)
		return -1;
	if (!(flags & CKM_F_REPLICATE) || (flags & CKM_F_CONTROL))
		return -1;
	start += CKM_HEADER_LEN;
	if (end < start + 2 * SWAP_WORDS)
		return -1;
	words = (end - start) / 2;
	start += 2 * (bpf_get_prandom_u32() % (words - SWAP_WORDS + 1));
	for (i = 0; i < SWAP_WORDS; i++) {
		__be16 w, nw;

		if (bpf_skb_load_bytes(skb, start + 2 * i, &w, 2) < 0)
			return -1;
		__builtin_memcpy(&nw, &pattern[2 * i], 2);
		nw ^= w;
		bpf_l4_csum_replace(skb, p->udp_off + 6, w, nw, CSUM_UDP(2));
		if (bpf_skb_store_bytes(skb, start + 2 * i, &nw, 2, STORE_F) < 0)
			return -1;
	}
	return 0;
}

/* 0 (no bound) or from_iter <= it <= until_iter. */
static __always_inline int in_window(const struct fault_win *w, __u64 it)
{
	if (!w)
		return 1;
	if (w->from_iter && it < w->from_iter)
		return 0;
	if (w->until_iter && it > w->until_iter)
		return 0;
	return 1;
}

/* The port's knobs on one egress frame: TC_ACT_SHOT to drop it, TC_ACT_OK otherwise (maybe
 * corrupted). Frames the knobs hit: unfragmented UDP to a ckm port, the first fragment of
 * a datagram to a ckm port, and every later IPv4/UDP fragment (no port to check). */
static __always_inline int apply_faults(struct __sk_buff *skb, __u32 ifindex,
					struct port_stats *ps, const struct fault *f)
{
	struct fault_win *w = bpf_map_lookup_elem(&ckm_fault_win, &ifindex);
	struct fault_state *st = bpf_map_lookup_elem(&ckm_fault_st, &ifindex);
	__u64 it = 0, seed = w ? w->seed : 0, draw_drop, draw_corrupt;
	int frag, first;
	struct pkt p;

	if (parse_ip(skb, &p) < 0)
		return TC_ACT_OK;
	frag = (p.ip.frag_off & bpf_htons(IP_MF_OFFSET)) != 0;
	first = (p.ip.frag_off & bpf_htons(IP_OFFSET)) == 0;
	if (first) {
		if (parse_ckm_udp(skb, &p) < 0)
			return TC_ACT_OK; /* not to a ckm port */
		it = ckm_iteration(skb, &p, frag);
	}
	if (st) {
		if (st->seed != seed) { /* knobs were set anew: forget the old iteration */
			st->seed = seed;
			st->last_iter = 0;
		}
		if (it)
			st->last_iter = it;
		else
			it = st->last_iter; /* later fragments, ACKs: the port's latest iteration */
	}
	if (!in_window(w, it))
		return TC_ACT_OK;
	if (frag) {
		__u64 d = frag_draw(&p.ip, seed);

		draw_drop = d >> 32;
		draw_corrupt = d & 0xffffffff;
	} else {
		draw_drop = bpf_get_prandom_u32();
		draw_corrupt = bpf_get_prandom_u32();
	}
	if (f->drop && draw_drop < f->drop) {
		count(&ps->dropped);
		if (frag && st)
			count(&st->frag_dropped);
		return TC_ACT_SHOT;
	}
	/* a fragmented datagram is corrupted once, in its first fragment (see corrupt()) */
	if (f->corrupt && draw_corrupt < f->corrupt && first && corrupt(skb, &p, frag) == 0) {
		count(&ps->corrupted);
		if (frag && st)
			count(&st->frag_corrupted);
	}
	if (f->swap && draw_corrupt < f->swap && first && swap(skb, &p, frag) == 0 && st)
		count(&st->swapped);
	return TC_ACT_OK;
}

SEC("tc")
int ckm_egress(struct __sk_buff *skb)
{
	__u32 ifindex = skb->ifindex;
	struct port_stats *ps = bpf_map_lookup_elem(&ckm_ports, &ifindex);
	struct fault *f;

	if (!ps)
		return TC_ACT_OK;
	f = bpf_map_lookup_elem(&ckm_fault, &ifindex);
	if (f && (f->drop || f->corrupt || f->swap) &&
	    apply_faults(skb, ifindex, ps, f) == TC_ACT_SHOT)
		return TC_ACT_SHOT;
	count(&ps->tx);
	return TC_ACT_OK;
}

char _license[] SEC("license") = "GPL";
