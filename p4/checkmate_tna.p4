/* Checkmate switch for Tofino (TNA).
 * Build (the SDE's bf-p4c, or the open-source p4c's Tofino backend, p4c-barefoot), into the
 * folder the controller reads, from the repository root:
 *   mkdir -p build/p4/checkmate_tna
 *   bf-p4c --target tofino --arch tna -I p4 -I p4/include -o build/p4/checkmate_tna \
 *       --p4runtime-files build/p4/checkmate_tna/p4info.txtpb,build/p4/checkmate_tna/p4info.bin \
 *       [--p4runtime-force-std-externs] p4/checkmate_tna.p4
 * (p4c takes P4Info suffixes .bin, .txt, .json and .txtpb; the controller reads p4info.bin
 * first, which keeps Tofino extern payloads intact, then p4info.txtpb;
 * the last flag makes counters standard P4Runtime counters, which Stratum serves and
 * `control status` reads; without it they are Tofino externs, read in bfrt.)
 * Same tables, keys and actions as checkmate_v1model.p4 (p4c's TNA P4Info prefixes tables
 * and counters, not actions, with "pipe."). Differences forced by the architecture:
 * - direct counters are counted explicitly in each action;
 * - an indexed counter (ckm_stats, l2_miss) may be accessed once per packet and never from
 *   an action that also counts a direct counter, so each outcome is put in a local and
 *   counted once at the end of the apply block;
 * - unicast and multicast are independent in the traffic manager, so a replicated
 *   datagram sets only mcast_grp_a (the group holds the destination, rid 0, and the shadow,
 *   rid = partition + 1) and L2 forwarding is skipped for it;
 * - lossless traffic (CkmLossless: well-formed ckm, DSCP CKM_DSCP or PCP CKM_COS) is put on
 *   queue CKM_QID with ingress_cos CKM_COS, the priority group that has PFC enabled
 *   (thresholds from `control deploy`, docs/pfc.md);
 * - the ingress port reaches egress in a bridged header (flood pruning);
 * - the IPv4 checksum of a shadow copy is recomputed in the egress deparser; the UDP
 *   checksum of the copy is set to zero (RFC 768 allows it over IPv4; the ckm CRC32C covers
 *   the payload);
 * - a parser error drops the frame on Tofino unless ingress reads parser_err: it does, and
 *   counts STAT_PARSER_ERROR and forwards the frame as far as it was parsed.
 * The same source check as v1model, first in ingress: a frame whose Ethernet source (or,
 * for IPv4, source address; for ARP, sender MAC and IP) is not the one bound to its ingress
 * port in port_bind is dropped (drop_ctl) and counted in src_check; nothing is learned.
 * The same anti-spoofing and length checks as v1model: a REPLICATE datagram is copied only
 * when it entered on the port its replication entry names (the source host's), and only
 * when its count agrees with its UDP length (CkmLengthCheck); otherwise it is forwarded
 * plainly and counted spoofed or malformed. The length check is written in the form Tofino
 * computes: 16-bit values in metadata, compared in if-conditions (checkmate_checks.p4).
 */
#include <core.p4>
#include <tna.p4>

#include "include/checkmate_parser.p4"
#include "include/checkmate_checks.p4"

parser CkmIngressParser(packet_in pkt, out headers_t hdr, out ckm_meta_t meta,
                        out ingress_intrinsic_metadata_t ig_intr_md) {
    CkmPacketParser() packet_parser;

    state start {
        pkt.extract(ig_intr_md);
        pkt.advance(PORT_METADATA_SIZE);
        packet_parser.apply(pkt, hdr.ethernet, hdr.vlan, hdr.arp, hdr.ipv4, hdr.udp, hdr.ckm,
                            meta);
        transition accept;
    }
}

control CkmIngress(inout headers_t hdr, inout ckm_meta_t meta,
                   in ingress_intrinsic_metadata_t ig_intr_md,
                   in ingress_intrinsic_metadata_from_parser_t ig_prsr_md,
                   inout ingress_intrinsic_metadata_for_deparser_t ig_dprsr_md,
                   inout ingress_intrinsic_metadata_for_tm_t ig_tm_md) {
    /* Indexed counters are never touched inside table actions (which count their table's
     * direct counter): each is counted once per packet, in the apply block. */
    Counter<bit<32>, bit<32>>(STAT_SIZE, CounterType_t.PACKETS_AND_BYTES) ckm_stats;
    Counter<bit<32>, bit<32>>(1, CounterType_t.PACKETS_AND_BYTES) l2_miss;
    Counter<bit<32>, bit<32>>(SRC_SIZE, CounterType_t.PACKETS_AND_BYTES) src_check;
    DirectCounter<bit<32>>(CounterType_t.PACKETS_AND_BYTES) port_bind_counter;
    DirectCounter<bit<32>>(CounterType_t.PACKETS_AND_BYTES) l2_fwd_counter;
    DirectCounter<bit<32>>(CounterType_t.PACKETS_AND_BYTES) ckm_punt_counter;
    DirectCounter<bit<32>>(CounterType_t.PACKETS_AND_BYTES) ckm_replicate_counter;

    action bind_source(bit<48> mac, bit<32> ip) {
        meta.bind_mac = mac;
        meta.bind_ip = ip;
        port_bind_counter.count();
    }

    table port_bind {
        key = {
            ig_intr_md.ingress_port: exact @name("ingress_port");
        }
        actions = {
            bind_source;
            @defaultonly NoAction;
        }
        default_action = NoAction();
        size = 512;
        counters = port_bind_counter;
    }

    action forward(PortId_t port) {
        ig_tm_md.ucast_egress_port = port;
        l2_fwd_counter.count();
    }

    action flood() {
        ig_tm_md.mcast_grp_a = FLOOD_GROUP;
        l2_fwd_counter.count();
    }

    action drop() {
        ig_dprsr_md.drop_ctl = 1;
        l2_fwd_counter.count();
    }

    table l2_fwd {
        key = {
            hdr.ethernet.dst_addr: exact @name("dst_mac");
        }
        actions = {
            forward;
            flood;
            drop;
        }
        default_action = flood();
        size = 1024;
        counters = l2_fwd_counter;
    }

    action to_cpu(PortId_t port) {
        ig_tm_md.ucast_egress_port = port;
        ckm_punt_counter.count();
    }

    table ckm_punt {
        key = {
            hdr.ipv4.dst_addr: exact @name("dst_ip");
            hdr.udp.dst_port: exact @name("udp_dst_port");
        }
        actions = {
            to_cpu;
            @defaultonly NoAction;
        }
        default_action = NoAction();
        size = 16;
        counters = ckm_punt_counter;
    }

    /* The group is used only if the datagram entered on ingress_port (apply block); the
     * direct counter counts matches, ckm_stats tells copies from spoofed ones. A miss has
     * no entry to count: no_entry does nothing and the apply block counts STAT_NO_ENTRY. */
    action replicate(MulticastGroupId_t group, PortId_t ingress_port) {
        meta.repl_group = group;
        meta.repl_port = ingress_port;
        ckm_replicate_counter.count();
    }

    action no_entry() {
    }

    table ckm_replicate {
        key = {
            hdr.ckm.job_id: exact @name("job_id");
            hdr.ipv4.src_addr: exact @name("src_ip");
            hdr.ipv4.dst_addr: exact @name("dst_ip");
            hdr.ckm.partition: exact @name("partition");
        }
        actions = {
            replicate;
            @defaultonly no_entry;
        }
        default_action = no_entry();
        size = 4096;
        counters = ckm_replicate_counter;
    }

    CkmLengthCheck() ckm_length;
    CkmLossless() ckm_lossless;

    apply {
        bool steered = false;
        bool well_formed = false;
        bool lossless = false;
        bool counted = false;     /* a datagram on a ckm port: one ckm_stats outcome */
        bit<32> outcome = STAT_PLAIN;
        bool source_ok = false;
        bit<32> source_bad = SRC_BAD_MAC;
        if (port_bind.apply().hit) {
            /* The 48-bit MAC compared as its high 16 and low 32 bits: one Tofino 1
             * gateway takes at most 4 bytes + 12 bits of PHV input. */
            if (hdr.ethernet.src_addr[47:32] == meta.bind_mac[47:32]) {
                if (hdr.ethernet.src_addr[31:0] == meta.bind_mac[31:0]) {
                    if (hdr.arp.isValid()) {
                        /* an ARP sender is checked as a source: its MAC, then its IP */
                        if (hdr.arp.hw_len != 6) {
                            source_bad = SRC_BAD_IP;
                        } else if (hdr.arp.proto_len != 4) {
                            source_bad = SRC_BAD_IP;
                        } else if (hdr.arp.sender_mac[47:32] != meta.bind_mac[47:32]) {
                            source_bad = SRC_BAD_MAC;
                        } else if (hdr.arp.sender_mac[31:0] != meta.bind_mac[31:0]) {
                            source_bad = SRC_BAD_MAC;
                        } else if (hdr.arp.sender_ip == meta.bind_ip) {
                            source_ok = true;
                        } else {
                            source_bad = SRC_BAD_IP;
                        }
                    } else if (!hdr.ipv4.isValid()) {
                        source_ok = true;
                    } else if (hdr.ipv4.src_addr == meta.bind_ip) {
                        source_ok = true;
                    } else {
                        source_bad = SRC_BAD_IP;
                    }
                }
            }
        }
        if (!source_ok) {
            src_check.count(source_bad);
            ig_dprsr_md.drop_ctl = 1;
            exit;
        }
        hdr.bridge.setValid();
        hdr.bridge.pad = 0;
        hdr.bridge.ingress_port = ig_intr_md.ingress_port;
        if (hdr.ckm.isValid()) {
            ckm_length.apply(hdr, meta, well_formed);
        }
        if (well_formed) {
            counted = true;
            if ((hdr.ckm.flags & CKM_F_HANDSHAKE) != 0) {
                if (ckm_punt.apply().hit) {
                    steered = true;
                    outcome = STAT_HANDSHAKE;
                }
            } else if ((hdr.ckm.flags & CKM_F_REPLICATE) != 0 &&
                       (hdr.ipv4.flags & IPV4_FLAG_MF) == 0) {  /* fragments: never copied */
                if (ckm_replicate.apply().hit) {
                    if (ig_intr_md.ingress_port == meta.repl_port) {
                        ig_tm_md.mcast_grp_a = meta.repl_group;
                        steered = true;
                        outcome = STAT_REPLICATED;
                    } else {
                        outcome = STAT_SPOOFED;
                    }
                } else {
                    outcome = STAT_NO_ENTRY;
                }
            }
        } else if (ig_prsr_md.parser_err != 0) {
            /* Consumed here: the frame is counted and forwarded as far as it was parsed. */
            counted = true;
            outcome = STAT_PARSER_ERROR;
        } else if (meta.ckm_port == 1) {
            counted = true;
            outcome = STAT_MALFORMED;
        }
        if (counted) {
            ckm_stats.count(outcome);
        }
        ckm_lossless.apply(hdr, well_formed, lossless);
        if (lossless) {
            ig_tm_md.qid = (QueueId_t)CKM_QID;  /* bit<5> on Tofino 1, bit<7> on Tofino 2 */
            ig_tm_md.ingress_cos = CKM_COS;
        }
        /* A replicated datagram reaches its destination through the group (rid 0). */
        if (!steered && hdr.ethernet.isValid()) {
            if (!l2_fwd.apply().hit) {
                l2_miss.count(0);  /* flooded: the default action has no entry to count */
            }
        }
    }
}

control CkmIngressDeparser(packet_out pkt, inout headers_t hdr, in ckm_meta_t meta,
                           in ingress_intrinsic_metadata_for_deparser_t ig_dprsr_md) {
    apply {
        pkt.emit(hdr.bridge);
        pkt.emit(hdr.ethernet);
        pkt.emit(hdr.vlan);
        pkt.emit(hdr.arp);
        pkt.emit(hdr.ipv4);
        pkt.emit(hdr.udp);
        pkt.emit(hdr.ckm);
    }
}

parser CkmEgressParser(packet_in pkt, out headers_t hdr, out ckm_meta_t meta,
                       out egress_intrinsic_metadata_t eg_intr_md) {
    CkmPacketParser() packet_parser;

    state start {
        pkt.extract(eg_intr_md);
        pkt.extract(hdr.bridge);
        packet_parser.apply(pkt, hdr.ethernet, hdr.vlan, hdr.arp, hdr.ipv4, hdr.udp, hdr.ckm,
                            meta);
        transition accept;
    }
}

control CkmEgress(inout headers_t hdr, inout ckm_meta_t meta,
                  in egress_intrinsic_metadata_t eg_intr_md,
                  in egress_intrinsic_metadata_from_parser_t eg_prsr_md,
                  inout egress_intrinsic_metadata_for_deparser_t eg_dprsr_md,
                  inout egress_intrinsic_metadata_for_output_port_t eg_oport_md) {
    DirectCounter<bit<32>>(CounterType_t.PACKETS_AND_BYTES) shadow_rewrite_counter;
    /* A replica for a shadow without a rewrite entry: the miss has no entry to count. */
    Counter<bit<32>, bit<32>>(1, CounterType_t.PACKETS_AND_BYTES) rewrite_miss;

    action rewrite_shadow(bit<48> smac, bit<48> dmac, bit<32> ip, bit<16> udp_port,
                          bit<32> epoch, bit<32> token) {
        hdr.ethernet.src_addr = smac;
        hdr.ethernet.dst_addr = dmac;
        hdr.ipv4.dst_addr = ip;
        hdr.udp.dst_port = udp_port;
        hdr.udp.checksum = 0;
        hdr.ckm.epoch = epoch;
        hdr.ckm.token = token;
        meta.shadow_copy = 1;
        shadow_rewrite_counter.count();
    }

    table shadow_rewrite {
        key = {
            eg_intr_md.egress_rid: exact @name("egress_rid");
        }
        actions = {
            rewrite_shadow;
            @defaultonly NoAction;
        }
        default_action = NoAction();
        size = 1024;
        counters = shadow_rewrite_counter;
    }

    apply {
        if (eg_intr_md.egress_rid != 0 && hdr.ckm.isValid()) {
            if (!shadow_rewrite.apply().hit) {
                rewrite_miss.count(0);
            }
        } else if (eg_intr_md.egress_port == hdr.bridge.ingress_port) {
            eg_dprsr_md.drop_ctl = 1;  /* never send a frame back where it came from */
        }
        hdr.bridge.setInvalid();
    }
}

control CkmEgressDeparser(packet_out pkt, inout headers_t hdr, in ckm_meta_t meta,
                          in egress_intrinsic_metadata_for_deparser_t eg_dprsr_md) {
    Checksum() ipv4_checksum;

    apply {
        if (meta.shadow_copy == 1) {
            hdr.ipv4.hdr_checksum = ipv4_checksum.update({
                hdr.ipv4.version, hdr.ipv4.ihl, hdr.ipv4.dscp, hdr.ipv4.ecn,
                hdr.ipv4.total_len, hdr.ipv4.identification, hdr.ipv4.flags,
                hdr.ipv4.frag_offset, hdr.ipv4.ttl, hdr.ipv4.protocol,
                hdr.ipv4.src_addr, hdr.ipv4.dst_addr });
        }
        pkt.emit(hdr.ethernet);
        pkt.emit(hdr.vlan);
        pkt.emit(hdr.arp);
        pkt.emit(hdr.ipv4);
        pkt.emit(hdr.udp);
        pkt.emit(hdr.ckm);
    }
}

Pipeline(CkmIngressParser(), CkmIngress(), CkmIngressDeparser(),
         CkmEgressParser(), CkmEgress(), CkmEgressDeparser()) pipe;

Switch(pipe) main;
