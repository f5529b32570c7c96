/* The ckm length check and the lossless-class test, shared by both programs as
 * sub-controls.
 * Length check:
 * A ckm datagram is well-formed only when its UDP payload is the 56-byte header followed by
 * exactly `count` elements of a known dtype (docs/protocol.md); the switch forwards any
 * other as plain traffic and never copies it (the kernel switch applies the same rule,
 * dataplane/bpf/ckm_switch.c). The UDP length field stands for the datagram's length: a
 * frame shorter than it never reaches a socket at the receiver. count is bounded to 16 bits
 * first (a UDP length is 16 bits), so count * size cannot wrap; the sizes are constants
 * from the generated ckm_headers.p4, so each product is a shift (no run-time multiply on
 * Tofino). */
#ifndef CHECKMATE_CHECKS_P4
#define CHECKMATE_CHECKS_P4

#include "checkmate_common.p4"

control CkmLengthCheck(in headers_t hdr, out bool ok) {
    apply {
        bit<32> payload = (bit<32>)hdr.udp.length - CKM_UDP_OVERHEAD;  /* wraps if short:
                                                                        * no count matches */
        bit<32> want = 0;
        ok = false;
        if (hdr.ckm.count[31:16] == 0) {
            if (hdr.ckm.dtype == CKM_DT_FLOAT32) {
                want = hdr.ckm.count * CKM_DT_FLOAT32_SIZE;
                ok = want == payload;
            } else if (hdr.ckm.dtype == CKM_DT_BFLOAT16) {
                want = hdr.ckm.count * CKM_DT_BFLOAT16_SIZE;
                ok = want == payload;
            } else if (hdr.ckm.dtype == CKM_DT_FLOAT16) {
                want = hdr.ckm.count * CKM_DT_FLOAT16_SIZE;
                ok = want == payload;
            } else if (hdr.ckm.dtype == CKM_DT_BYTES) {
                want = hdr.ckm.count * CKM_DT_BYTES_SIZE;
                ok = want == payload;
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
