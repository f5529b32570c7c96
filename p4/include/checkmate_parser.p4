/* Ethernet / 802.1Q / ARP / IPv4 / UDP / ckm parsing, shared by both architectures as a sub-parser.
 * One VLAN tag is parsed (hosts that tag ckm frames put CKM_COS in its PCP); a frame with a
 * second tag is plain traffic.
 * A datagram is parsed as ckm only when its UDP destination port lies in
 * CKM_PORT_BASE .. CKM_PORT_BASE + CKM_PORT_COUNT - 1 (47000..48023) and the first three
 * payload bytes carry the ckm magic and version. The port range is not aligned to a power
 * of two, so it is written as eight value/mask blocks; tests/test_p4_sources.py checks
 * that they cover exactly the Python range. A foreign payload on a ckm port leaves hdr.ckm
 * invalid with meta.ckm_port set: ingress counts it as malformed and forwards it as plain
 * traffic; a payload shorter than the ckm header is a parser error (PacketTooShort), which
 * ingress counts and forwards too.
 * Every parameter is `out`: the caller passes nothing the parser reads (the headers it
 * does not reach stay invalid, and every metadata field is set in `start`), so no field is
 * read uninitialized (p4c's --Wwarn=uninitialized-use and uninitialized-out-param). */
#ifndef CHECKMATE_PARSER_P4
#define CHECKMATE_PARSER_P4

#include "checkmate_common.p4"

parser CkmPacketParser(packet_in pkt, out ethernet_h ethernet, out vlan_h vlan, out arp_h arp,
                       out ipv4_h ipv4, out udp_h udp, out ckm_h ckm, out ckm_meta_t meta) {
    state start {
        meta.ckm_port = 0;
        meta.shadow_copy = 0;
        meta.repl_group = 0;
        meta.repl_port = 0;
        meta.bind_mac = 0;
        meta.bind_ip = 0;
        meta.len_payload = 0;
        meta.len_float32 = 0;
        meta.len_bfloat16 = 0;
        meta.len_float16 = 0;
        meta.len_bytes = 0;
        pkt.extract(ethernet);
        transition select(ethernet.ether_type) {
            ETHERTYPE_VLAN: parse_vlan;
            ETHERTYPE_ARP: parse_arp;
            ETHERTYPE_IPV4: parse_ipv4;
            default: accept;
        }
    }

    state parse_vlan {
        pkt.extract(vlan);
        transition select(vlan.ether_type) {
            ETHERTYPE_ARP: parse_arp;
            ETHERTYPE_IPV4: parse_ipv4;
            default: accept;
        }
    }

    /* Its sender's addresses are checked against the port's binding like an IPv4 source. */
    state parse_arp {
        pkt.extract(arp);
        transition accept;
    }

    state parse_ipv4 {
        pkt.extract(ipv4);
        /* No IP options, first fragment only: anything else is plain traffic. */
        transition select(ipv4.ihl, ipv4.frag_offset, ipv4.protocol) {
            (4w5, 13w0, IPPROTO_UDP): parse_udp;
            default: accept;
        }
    }

    state parse_udp {
        pkt.extract(udp);
        transition select(udp.dst_port) {
            16w0xb798 &&& 16w0xfff8: ckm_port;  /* 47000 .. 47007 */
            16w0xb7a0 &&& 16w0xffe0: ckm_port;  /* 47008 .. 47039 */
            16w0xb7c0 &&& 16w0xffc0: ckm_port;  /* 47040 .. 47103 */
            16w0xb800 &&& 16w0xfe00: ckm_port;  /* 47104 .. 47615 */
            16w0xba00 &&& 16w0xff00: ckm_port;  /* 47616 .. 47871 */
            16w0xbb00 &&& 16w0xff80: ckm_port;  /* 47872 .. 47999 */
            16w0xbb80 &&& 16w0xfff0: ckm_port;  /* 48000 .. 48015 */
            16w0xbb90 &&& 16w0xfff8: ckm_port;  /* 48016 .. 48023 */
            default: accept;
        }
    }

    state ckm_port {
        meta.ckm_port = 1;
        /* magic ++ version must match before the 56-byte header is extracted. */
        transition select(pkt.lookahead<bit<24>>()) {
            ((bit<16>)CKM_MAGIC ++ (bit<8>)CKM_VERSION): parse_ckm;
            default: accept;
        }
    }

    state parse_ckm {
        pkt.extract(ckm);
        transition accept;
    }
}

#endif
