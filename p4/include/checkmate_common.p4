/* Checkmate P4: header types, metadata and constants shared by the TNA and v1model programs.
 * The ckm header itself comes from ckm_headers.p4, generated from checkmate/protocol/wire.py. */
#ifndef CHECKMATE_COMMON_P4
#define CHECKMATE_COMMON_P4

#include "ckm_headers.p4"

const bit<16> ETHERTYPE_IPV4 = 0x0800;
const bit<16> ETHERTYPE_ARP = 0x0806;
const bit<16> ETHERTYPE_VLAN = 0x8100;  /* 802.1Q: one tag is parsed (its PCP classifies) */
const bit<8> IPPROTO_UDP = 17;
/* IPv4 flags: more fragments (set on every fragment but the last). */
const bit<3> IPV4_FLAG_MF = 1;
/* UDP header + ckm header: a ckm datagram's UDP length is this plus its payload. */
const bit<16> CKM_UDP_OVERHEAD = 8 + CKM_HEADER_LEN;
/* UDP port of the controller's handshake service (checkmate.config.cluster.CONTROLLER_PORT). */
const bit<16> CKM_CONTROLLER_PORT = CKM_PORT_BASE + CKM_PORT_COUNT - 1;
/* Multicast group flooding broadcast/unknown frames to every host port and the CPU port. */
const bit<16> FLOOD_GROUP = 1;
/* 802.1p priority / ingress cos / queue of ckm traffic: PFC makes this class lossless. A
 * frame is in the class when it is a well-formed ckm datagram, when its IPv4 DSCP is
 * CKM_DSCP (hosts mark ckm sockets with it, docs/pfc.md) or when its 802.1Q PCP is
 * CKM_COS. */
const bit<3> CKM_COS = 3;
const bit<5> CKM_QID = 3;
const bit<6> CKM_DSCP = 24;

/* Indexes of the ckm_stats counter array (read by `control status`). Every datagram on a
 * ckm port gets exactly one outcome, counted once at the end of ingress: Tofino allows one
 * access per packet to an indexed counter. Well-formed datagrams = the sum of PLAIN,
 * REPLICATED, NO_ENTRY, HANDSHAKE and SPOOFED. */
const bit<32> STAT_PLAIN = 0;        /* well-formed, forwarded as it is (not a REPLICATE or a
                                      * HANDSHAKE for the controller, or a fragment) */
const bit<32> STAT_REPLICATED = 1;   /* REPLICATE datagrams copied to a shadow */
const bit<32> STAT_NO_ENTRY = 2;     /* REPLICATE datagrams without an entry: forwarded only */
const bit<32> STAT_MALFORMED = 3;    /* on a ckm port but bad magic/version, an unknown dtype
                                      * or a count that disagrees with the UDP length:
                                      * forwarded as plain traffic */
const bit<32> STAT_HANDSHAKE = 4;    /* HANDSHAKE datagrams punted to the controller */
const bit<32> STAT_SPOOFED = 5;      /* REPLICATE datagrams matching an entry that entered
                                      * on another port than their source host's: forwarded
                                      * only */
const bit<32> STAT_PARSER_ERROR = 6; /* the parser stopped early (a frame shorter than its
                                      * headers): forwarded as far as it was parsed */
const bit<32> STAT_SIZE = 8;

/* Indexes of the src_check counter: frames dropped on entering because their source is not
 * the one bound to their ingress port (table port_bind, written by the controller from the
 * config: each port's host's MAC and IPv4 address; the CPU port's is the switch's). A port
 * without a binding drops everything (SRC_BAD_MAC). Counted once per dropped frame, in the
 * apply block, before anything else looks at the frame. */
const bit<32> SRC_BAD_MAC = 0;       /* Ethernet (or ARP sender) MAC is not the port's host's */
const bit<32> SRC_BAD_IP = 1;        /* IPv4 source (or ARP sender IP) is not the port's host's,
                                      * or an ARP header for other than Ethernet/IPv4 */
const bit<32> SRC_SIZE = 2;

header ethernet_h {
    bit<48> dst_addr;
    bit<48> src_addr;
    bit<16> ether_type;
}

header vlan_h {
    bit<3> pcp;
    bit<1> dei;
    bit<12> vid;
    bit<16> ether_type;
}

/* ARP (RFC 826) up to the sender's addresses, all the source check reads; the target's
 * addresses stay payload. */
header arp_h {
    bit<16> hw_type;
    bit<16> proto_type;
    bit<8> hw_len;
    bit<8> proto_len;
    bit<16> oper;
    bit<48> sender_mac;
    bit<32> sender_ip;
}

header ipv4_h {
    bit<4> version;
    bit<4> ihl;
    bit<6> dscp;
    bit<2> ecn;
    bit<16> total_len;
    bit<16> identification;
    bit<3> flags;
    bit<13> frag_offset;
    bit<8> ttl;
    bit<8> protocol;
    bit<16> hdr_checksum;
    bit<32> src_addr;
    bit<32> dst_addr;
}

header udp_h {
    bit<16> src_port;
    bit<16> dst_port;
    bit<16> length;
    bit<16> checksum;
}

/* TNA only: ingress -> egress bridged metadata (egress needs the ingress port to prune
 * floods). v1model has standard_metadata for this and never emits it. */
header ckm_bridge_h {
    bit<7> pad;
    bit<9> ingress_port;
}

struct headers_t {
    ckm_bridge_h bridge;
    ethernet_h ethernet;
    vlan_h vlan;
    arp_h arp;
    ipv4_h ipv4;
    udp_h udp;
    ckm_h ckm;
}

struct ckm_meta_t {
    bit<1> ckm_port;     /* UDP destination port lies in the ckm range */
    bit<1> shadow_copy;  /* egress: this replica was rewritten for a shadow */
    bit<16> repl_group;  /* ingress: the matching replication entry's multicast group */
    bit<9> repl_port;    /* ingress: the port that entry's source host is attached to */
    bit<48> bind_mac;    /* ingress: the MAC bound to the ingress port (port_bind) */
    bit<32> bind_ip;     /* ingress: the IPv4 address bound to the ingress port */
    /* CkmLengthCheck's 16-bit values (metadata, not locals, so that each stays a field
     * the gateways compare; checkmate_checks.p4) */
    bit<16> len_payload;  /* udp.length - CKM_UDP_OVERHEAD */
    bit<16> len_float32;  /* count[15:0] * CKM_DT_FLOAT32_SIZE, and so on per dtype */
    bit<16> len_bfloat16;
    bit<16> len_float16;
    bit<16> len_bytes;
}

#endif
