//! The host-bytes payloads of `Nccl`'s small collectives (counts, sums) as bytes on the wire,
//! and back, refusing what does not decode. No CUDA here, so it is tested on every machine.

use mpipemoe::comm::Payload;

/// A payload as bytes: a kind tag, then little-endian values.
pub(crate) fn encode(payload: &Payload) -> Vec<u8> {
    match payload {
        Payload::Bytes(b) => std::iter::once(0u8).chain(b.iter().copied()).collect(),
        Payload::Counts(c) => std::iter::once(1u8)
            .chain(c.iter().flat_map(|v| (*v as u64).to_le_bytes()))
            .collect(),
        Payload::Values(v) => std::iter::once(2u8)
            .chain(v.iter().flat_map(|x| x.to_le_bytes()))
            .collect(),
        Payload::Floats(v) => std::iter::once(3u8)
            .chain(v.iter().flat_map(|x| x.to_le_bytes()))
            .collect(),
    }
}

pub(crate) fn decode(bytes: &[u8]) -> Option<Payload> {
    let (tag, body) = bytes.split_first()?;
    let words = || {
        (body.len() % 8 == 0).then(|| {
            body.chunks_exact(8)
                .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
        })
    };
    match tag {
        0 => Some(Payload::Bytes(body.to_vec())),
        1 => Some(Payload::Counts(
            words()?.map(|v| usize::try_from(v).ok()).collect::<Option<_>>()?,
        )),
        2 => Some(Payload::Values(words()?.map(f64::from_bits).collect())),
        3 => (body.len() % 4 == 0).then(|| {
            Payload::Floats(
                body.chunks_exact(4)
                    .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
                    .collect(),
            )
        }),
        _ => None,
    }
}

/// The largest host-bytes payload a peer may announce (16 GiB): a bound on what a corrupted
/// size can make this rank allocate. Rows normally take the device path.
pub(crate) const MAX_PAYLOAD_BYTES: usize = 1 << 34;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn payloads_round_trip_and_garbage_is_refused() {
        for p in [
            Payload::Bytes(vec![1, 2, 3]),
            Payload::Counts(vec![0, 7, usize::MAX >> 1]),
            Payload::Values(vec![1.5, -0.0, f64::INFINITY]),
            Payload::Floats(vec![0.25, -3.0, f32::MAX]),
            Payload::Counts(Vec::new()),
        ] {
            assert_eq!(decode(&encode(&p)), Some(p));
        }
        assert_eq!(decode(&[]), None);
        assert_eq!(decode(&[9, 1, 2]), None);
        assert_eq!(decode(&[1, 1, 2, 3]), None);
        assert_eq!(decode(&[3, 1, 2, 3]), None);
    }
}
