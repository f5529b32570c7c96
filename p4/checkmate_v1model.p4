/* Checkmate switch for bmv2 (v1model): simple_switch (Thrift runtime) or simple_switch_grpc.
 * Build, into the folder the controller and the bmv2 testbed read, from the repository root:
 *   mkdir -p build/p4/checkmate_v1model
 *   p4c-bm2-ss --arch v1model -I p4 -I p4/include \
 *       -o build/p4/checkmate_v1model/checkmate_v1model.json \
 *       --p4runtime-files build/p4/checkmate_v1model/p4info.txtpb p4/checkmate_v1model.p4
 * Needs a v1model.p4 with standard_metadata.priority (p4c >= 1.2.0) and simple_switch
 * started with --priority-queues for the ckm class to get its own queue.
 *
 * Ingress: first the source check: a frame whose Ethernet source is not the MAC bound to
 * its ingress port (port_bind, from the config; no entry: nothing is bound), or, for IPv4,
 * whose source address, or, for ARP, whose sender MAC or IP is not the bound one, is
 * dropped and counted in src_check, so no host can use another's addresses (a MAC hijack,
 * an ARP reply claiming another's IP, a forged source IP on a register or a REPLICATE).
 * Forwarding entries are the controller's only: nothing is learned.
 * Then L2 forwarding by destination MAC (flood group for unknown/broadcast, counted in
 * l2_miss); ckm datagrams whose count agrees with their UDP length (CkmLengthCheck), and
 * frames marked with DSCP CKM_DSCP or PCP CKM_COS (CkmLossless), go to the ckm priority;
 * other datagrams on ckm ports are counted malformed (or parser errors) and forwarded as
 * plain traffic; every datagram on a ckm port gets one ckm_stats outcome, counted once;
 * unfragmented
 * REPLICATE datagrams whose (job, src IP, dst IP, partition) match ckm_replicate and that
 * entered on the port the entry names (the source host's: a copy carries the shadow's
 * valid epoch/token, so a forged source's copy would be accepted) are multicast to a group
 * holding the destination's port (rid 0, unchanged) and the shadow's port (rid =
 * partition + 1); from any other port they are counted spoofed and forwarded plainly;
 * HANDSHAKE datagrams to the controller's address/port are sent to the CPU port, where the
 * controller's UDP socket receives them as ordinary frames (docs/protocol.md, Handshake).
 * Egress: the replica with a non-zero rid is rewritten for its shadow (shadow_rewrite):
 * MACs, IPv4 destination, UDP destination port, epoch and token; the IPv4 checksum is
 * recomputed and the UDP checksum set to zero (legal for UDP over IPv4, RFC 768; the
 * ckm CRC32C still protects the payload, and the rewritten fields are not covered by it).
 */
#include <core.p4>
#include <v1model.p4>

#include "include/checkmate_parser.p4"
#include "include/checkmate_checks.p4"

parser CkmParser(packet_in pkt, out headers_t hdr, inout ckm_meta_t meta,
                 inout standard_metadata_t std_md) {
    CkmPacketParser() packet_parser;

    state start {
        packet_parser.apply(pkt, hdr.ethernet, hdr.vlan, hdr.arp, hdr.ipv4, hdr.udp, hdr.ckm,
                            meta);
        transition accept;
    }
}

control CkmVerifyChecksum(inout headers_t hdr, inout ckm_meta_t meta) {
    apply { }
}

control CkmIngress(inout headers_t hdr, inout ckm_meta_t meta,
                   inout standard_metadata_t std_md) {
    /* Counted as on Tofino (checkmate_tna.p4): each indexed counter once per packet, in
     * the apply block, never inside a table action. */
    counter(STAT_SIZE, CounterType.packets_and_bytes) ckm_stats;
    counter(1, CounterType.packets_and_bytes) l2_miss;
    counter(SRC_SIZE, CounterType.packets_and_bytes) src_check;
    direct_counter(CounterType.packets_and_bytes) port_bind_counter;
    direct_counter(CounterType.packets_and_bytes) l2_fwd_counter;
    direct_counter(CounterType.packets_and_bytes) ckm_punt_counter;
    direct_counter(CounterType.packets_and_bytes) ckm_replicate_counter;

    action bind_source(bit<48> mac, bit<32> ip) {
        meta.bind_mac = mac;
        meta.bind_ip = ip;
    }

    table port_bind {
        key = {
            std_md.ingress_port: exact @name("ingress_port");
        }
        actions = {
            bind_source;
            @defaultonly NoAction;
        }
        default_action = NoAction();
        size = 512;
        counters = port_bind_counter;
    }

    action forward(bit<9> port) {
        std_md.egress_spec = port;
    }

    action flood() {
        std_md.mcast_grp = FLOOD_GROUP;
    }

    action drop() {
        mark_to_drop(std_md);
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

    action to_cpu(bit<9> port) {
        std_md.egress_spec = port;
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

    /* The group is used only if the datagram entered on ingress_port (apply block). */
    action replicate(bit<16> group, bit<9> ingress_port) {
        meta.repl_group = group;
        meta.repl_port = ingress_port;
    }

    action no_entry() {  /* the apply block counts STAT_NO_ENTRY */
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
            if (hdr.ethernet.src_addr == meta.bind_mac) {
                if (hdr.arp.isValid()) {
                    /* an ARP sender is checked as a source: its MAC, then its IP */
                    if (hdr.arp.hw_len != 6 || hdr.arp.proto_len != 4) {
                        source_bad = SRC_BAD_IP;
                    } else if (hdr.arp.sender_mac != meta.bind_mac) {
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
        if (!source_ok) {
            src_check.count(source_bad);
            drop();
            exit;
        }
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
                    if (std_md.ingress_port == meta.repl_port) {
                        std_md.mcast_grp = meta.repl_group;
                        steered = true;
                        outcome = STAT_REPLICATED;
                    } else {
                        outcome = STAT_SPOOFED;
                    }
                } else {
                    outcome = STAT_NO_ENTRY;
                }
            }
        } else if (std_md.parser_error != error.NoError) {
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
            std_md.priority = CKM_COS;
        }
        /* A replicated datagram reaches its destination through the group (rid 0). */
        if (!steered && hdr.ethernet.isValid()) {
            if (!l2_fwd.apply().hit) {
                l2_miss.count(0);  /* flooded: the default action has no entry to count */
            }
        }
    }
}

control CkmEgress(inout headers_t hdr, inout ckm_meta_t meta,
                  inout standard_metadata_t std_md) {
    direct_counter(CounterType.packets_and_bytes) shadow_rewrite_counter;
    /* A replica for a shadow without a rewrite entry: the miss has no entry to count. */
    counter(1, CounterType.packets_and_bytes) rewrite_miss;

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
    }

    table shadow_rewrite {
        key = {
            std_md.egress_rid: exact @name("egress_rid");
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
        if (std_md.egress_rid != 0 && hdr.ckm.isValid()) {
            if (!shadow_rewrite.apply().hit) {
                rewrite_miss.count(0);
            }
        } else if (std_md.egress_port == std_md.ingress_port) {
            mark_to_drop(std_md);  /* never send a frame back where it came from (floods) */
        }
    }
}

control CkmComputeChecksum(inout headers_t hdr, inout ckm_meta_t meta) {
    apply {
        update_checksum(
            hdr.ipv4.isValid() && meta.shadow_copy == 1,
            { hdr.ipv4.version, hdr.ipv4.ihl, hdr.ipv4.dscp, hdr.ipv4.ecn,
              hdr.ipv4.total_len, hdr.ipv4.identification, hdr.ipv4.flags,
              hdr.ipv4.frag_offset, hdr.ipv4.ttl, hdr.ipv4.protocol,
              hdr.ipv4.src_addr, hdr.ipv4.dst_addr },
            hdr.ipv4.hdr_checksum,
            HashAlgorithm.csum16);
    }
}

control CkmDeparser(packet_out pkt, in headers_t hdr) {
    apply {
        pkt.emit(hdr.ethernet);
        pkt.emit(hdr.vlan);
        pkt.emit(hdr.arp);
        pkt.emit(hdr.ipv4);
        pkt.emit(hdr.udp);
        pkt.emit(hdr.ckm);
    }
}

V1Switch(CkmParser(), CkmVerifyChecksum(), CkmIngress(), CkmEgress(), CkmComputeChecksum(),
         CkmDeparser()) main;
