/* Checksums and MACs the ckm wire needs (docs/protocol.md): CRC32C of payloads, the
 * SipHash-2-4 data tag a shadow checks, and HMAC-SHA256 to derive its key from the job
 * secret. tests/test_nccl_crypto.py checks each against Python's. */
#ifndef CKM_CRYPTO_H
#define CKM_CRYPTO_H

#include <stddef.h>
#include <stdint.h>

uint32_t ckm_crc32c(const void *data, size_t len);
uint64_t ckm_siphash24(uint64_t k0, uint64_t k1, const void *data, size_t len);
void ckm_hmac_sha256(const void *key, size_t klen, const void *msg, size_t mlen,
		     uint8_t out[32]);
/* The 56-bit data tag of a gradient datagram (checkmate/protocol/datamac.py, tag56). */
uint64_t ckm_data_tag(uint64_t k0, uint64_t k1, uint32_t job, uint8_t flags, uint16_t partition,
		      uint8_t dtype, uint64_t iteration, uint64_t offset, uint32_t count,
		      uint32_t crc);

#endif
