/* The ckm length check and the lossless-class test, shared by both programs as
 * sub-controls.
 *
 * Length check. A ckm datagram is well-formed only when its UDP payload is the 56-byte
 * header followed by exactly `count` elements of a known dtype (docs/protocol.md); the
 * switch forwards any other as plain traffic and never copies it (the kernel switch applies
 * the same rule, dataplane/bpf/ckm_switch.c length_ok). The UDP length field stands for the
 * datagram's length: a frame shorter than it never reaches a socket at the receiver.
 *
 * Written in the form Tofino computes (issue 26; the compiler's answers to the earlier
 * forms are in docs/architecture.md, "Compiling for Tofino"):
 * - only 16-bit values: a UDP length is 16 bits, so the payload is at most
 *   CKM_MAX_PAYLOAD bytes and a count whose product with the element size exceeds it can
 *   never match; count is bounded first (count[31:16] == 0, then count[15:0] <=
 *   CKM_MAX_PAYLOAD / size), after which count[15:0] * size fits 16 bits. No 32-bit
 *   arithmetic and no cast to 32 bits (the 32-bit subtraction spanned stages; the 32-bit
 *   compare of a cast value crashed the backend);
 * - every value is computed by a plain assignment into metadata, all in one step with no
 *   value depending on another (one action, one stage): payload = udp.length -
 *   CKM_UDP_OVERHEAD (one 16-bit subtract of a constant) and, per dtype, count[15:0] *
 *   size (size is a generated power-of-two constant: one shift). That action is run by a
 *   keyless hidden table (no P4Info object): assigned in the apply block, the compiler
 *   folded the expressions into the conditions, which a Tofino gateway cannot evaluate
 *   ("condition expression too complex"); after a table it compares two 16-bit fields;
 * - the comparisons are if-conditions (gateways) on those fields and constants, and `ok`
 *   is only ever assigned a constant; the earlier `ok = want == payload;` put the value of
 *   a comparison into an action ("source of modify_field invalid");
 * - udp.length >= CKM_UDP_OVERHEAD is tested before the subtraction is trusted (a shorter
 *   length would wrap the 16-bit payload).
 * Same meaning as count * size == udp.length - CKM_UDP_OVERHEAD over unbounded integers,
 * which is what the kernel switch computes in 64 bits (tests/test_p4_sources.py evaluates
 * both over the boundary cases). */
#ifndef CHECKMATE_CHECKS_P4
#define CHECKMATE_CHECKS_P4

#include "checkmate_common.p4"

/* The longest UDP payload a ckm datagram can declare: 16-bit UDP length less header+ckm. */
#define CKM_MAX_PAYLOAD (65535 - 8 - CKM_HEADER_LEN)

control CkmLengthCheck(in headers_t hdr, inout ckm_meta_t meta, out bool ok) {
    /* The lengths are computed by a table's action, not in the apply block: the compiler
     * cannot see through a table, so each gateway below compares two 16-bit fields
     * instead of the expressions folded into it ("condition expression too complex"). */
    @hidden action lengths() {
        meta.len_payload = hdr.udp.length - CKM_UDP_OVERHEAD;
        meta.len_float32 = hdr.ckm.count[15:0] * CKM_DT_FLOAT32_SIZE;
        meta.len_bfloat16 = hdr.ckm.count[15:0] * CKM_DT_BFLOAT16_SIZE;
        meta.len_float16 = hdr.ckm.count[15:0] * CKM_DT_FLOAT16_SIZE;
        meta.len_bytes = hdr.ckm.count[15:0] * CKM_DT_BYTES_SIZE;
    }

    @hidden table compute_lengths {
        actions = {
            lengths;
        }
        const default_action = lengths();
        size = 1;
    }

    apply {
        compute_lengths.apply();
        ok = false;
        if (hdr.udp.length >= CKM_UDP_OVERHEAD && hdr.ckm.count[31:16] == 0) {
            if (hdr.ckm.dtype == CKM_DT_FLOAT32) {
                if (hdr.ckm.count[15:0] <= CKM_MAX_PAYLOAD / CKM_DT_FLOAT32_SIZE) {
                    if (meta.len_float32 == meta.len_payload) {
                        ok = true;
                    }
                }
            } else if (hdr.ckm.dtype == CKM_DT_BFLOAT16) {
                if (hdr.ckm.count[15:0] <= CKM_MAX_PAYLOAD / CKM_DT_BFLOAT16_SIZE) {
                    if (meta.len_bfloat16 == meta.len_payload) {
                        ok = true;
                    }
                }
            } else if (hdr.ckm.dtype == CKM_DT_FLOAT16) {
                if (hdr.ckm.count[15:0] <= CKM_MAX_PAYLOAD / CKM_DT_FLOAT16_SIZE) {
                    if (meta.len_float16 == meta.len_payload) {
                        ok = true;
                    }
                }
            } else if (hdr.ckm.dtype == CKM_DT_BYTES) {
                if (hdr.ckm.count[15:0] <= CKM_MAX_PAYLOAD / CKM_DT_BYTES_SIZE) {
                    if (meta.len_bytes == meta.len_payload) {
                        ok = true;
                    }
                }
            }
        }
    }
}

/* The lossless ckm class (docs/pfc.md): a well-formed ckm datagram, or any frame its host
 * marked, by DSCP or by 802.1Q PCP. A host that marks traffic this way is trusted with the
 * class, as NICs trust it (mlnx_qos --trust dscp). */
control CkmLossless(in headers_t hdr, in bool well_formed, out bool lossless) {
    apply {
        lossless = well_formed;
        if (hdr.ipv4.isValid()) {
            if (hdr.ipv4.dscp == CKM_DSCP) {
                lossless = true;
            }
        }
        if (hdr.vlan.isValid()) {
            if (hdr.vlan.pcp == CKM_COS) {
                lossless = true;
            }
        }
    }
}

#endif
