// SPDX-License-Identifier: MIT OR Apache-2.0
//! GGML block formats to f32. Each function takes the raw blocks of one tensor and appends
//! `blocks * block_len` values. Layouts are the GGML file format's.

use half::f16;

fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// Elements per block and bytes per block of each supported quantised type.
pub fn block_geometry(ggml_type: u32) -> Option<(usize, usize)> {
    Some(match ggml_type {
        0 => (1, 4),      // F32
        1 => (1, 2),      // F16
        30 => (1, 2),     // BF16
        2 => (32, 18),    // Q4_0
        3 => (32, 20),    // Q4_1
        6 => (32, 22),    // Q5_0
        8 => (32, 34),    // Q8_0
        12 => (256, 144), // Q4_K
        13 => (256, 176), // Q5_K
        14 => (256, 210), // Q6_K
        _ => return None,
    })
}

/// The GGML type's name, for messages.
pub fn type_name(ggml_type: u32) -> String {
    match ggml_type {
        0 => "F32",
        1 => "F16",
        2 => "Q4_0",
        3 => "Q4_1",
        6 => "Q5_0",
        7 => "Q5_1",
        8 => "Q8_0",
        9 => "Q8_1",
        10 => "Q2_K",
        11 => "Q3_K",
        12 => "Q4_K",
        13 => "Q5_K",
        14 => "Q6_K",
        15 => "Q8_K",
        16 => "IQ2_XXS",
        17 => "IQ2_XS",
        18 => "IQ3_XXS",
        19 => "IQ1_S",
        20 => "IQ4_NL",
        21 => "IQ3_S",
        22 => "IQ2_S",
        23 => "IQ4_XS",
        24 => "I8",
        25 => "I16",
        26 => "I32",
        27 => "I64",
        28 => "F64",
        29 => "IQ1_M",
        30 => "BF16",
        _ => return format!("type {ggml_type}"),
    }
    .to_string()
}

/// Dequantises `raw` (whole blocks of `ggml_type`) into `out`.
pub fn dequantize(ggml_type: u32, raw: &[u8], out: &mut Vec<f32>) {
    let (_, block_bytes) = block_geometry(ggml_type).expect("caller checked the type");
    for b in raw.chunks_exact(block_bytes) {
        match ggml_type {
            0 => out.push(f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
            1 => out.push(f16_at(b, 0)),
            30 => out.push(f32::from_bits(
                u32::from(u16::from_le_bytes([b[0], b[1]])) << 16,
            )),
            2 => {
                let d = f16_at(b, 0);
                let qs = &b[2..18];
                out.extend(qs.iter().map(|q| ((q & 0xF) as i32 - 8) as f32 * d));
                out.extend(qs.iter().map(|q| ((q >> 4) as i32 - 8) as f32 * d));
            }
            3 => {
                let (d, m) = (f16_at(b, 0), f16_at(b, 2));
                let qs = &b[4..20];
                out.extend(qs.iter().map(|q| (q & 0xF) as f32 * d + m));
                out.extend(qs.iter().map(|q| (q >> 4) as f32 * d + m));
            }
            6 => {
                let d = f16_at(b, 0);
                let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
                let qs = &b[6..22];
                let low = (0..16).map(|j| {
                    let hi = ((qh >> j) << 4) & 0x10;
                    (((qs[j] & 0xF) as u32 | hi) as i32 - 16) as f32 * d
                });
                let high: Vec<f32> = (0..16)
                    .map(|j| {
                        let hi = (qh >> (j + 12)) & 0x10;
                        (((qs[j] >> 4) as u32 | hi) as i32 - 16) as f32 * d
                    })
                    .collect();
                out.extend(low);
                out.extend(high);
            }
            8 => {
                let d = f16_at(b, 0);
                out.extend(b[2..34].iter().map(|&q| q as i8 as f32 * d));
            }
            12 | 13 => dequant_q4k_q5k(ggml_type == 13, b, out),
            14 => dequant_q6k(b, out),
            _ => unreachable!("block_geometry rejects other types"),
        }
    }
}

/// The 6-bit scale and min of sub-block `j` of a Q4_K/Q5_K block's 12 packed scale bytes.
fn scale_min(j: usize, q: &[u8]) -> (f32, f32) {
    if j < 4 {
        ((q[j] & 63) as f32, (q[j + 4] & 63) as f32)
    } else {
        (
            ((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4)) as f32,
            ((q[j + 4] >> 4) | ((q[j] >> 6) << 4)) as f32,
        )
    }
}

fn dequant_q4k_q5k(five_bit: bool, b: &[u8], out: &mut Vec<f32>) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let scales = &b[4..16];
    let (qh, qs) = if five_bit {
        (&b[16..48], &b[48..176])
    } else {
        (&b[0..0], &b[16..144])
    };
    for chunk in 0..4 {
        let (sc1, m1) = scale_min(2 * chunk, scales);
        let (sc2, m2) = scale_min(2 * chunk + 1, scales);
        let q = &qs[chunk * 32..chunk * 32 + 32];
        let (bit_lo, bit_hi) = (1u8 << (2 * chunk), 2u8 << (2 * chunk));
        for l in 0..32 {
            let high = if five_bit && qh[l] & bit_lo != 0 {
                16.0
            } else {
                0.0
            };
            out.push(d * sc1 * ((q[l] & 0xF) as f32 + high) - dmin * m1);
        }
        for l in 0..32 {
            let high = if five_bit && qh[l] & bit_hi != 0 {
                16.0
            } else {
                0.0
            };
            out.push(d * sc2 * ((q[l] >> 4) as f32 + high) - dmin * m2);
        }
    }
}

fn dequant_q6k(b: &[u8], out: &mut Vec<f32>) {
    let (ql_all, qh_all, sc_all) = (&b[0..128], &b[128..192], &b[192..208]);
    let d = f16_at(b, 208);
    for half in 0..2 {
        let (ql, qh, sc) = (
            &ql_all[half * 64..],
            &qh_all[half * 32..],
            &sc_all[half * 8..],
        );
        let mut y = [0f32; 128];
        for l in 0..32 {
            let is = l / 16;
            let q1 = ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) as i32 - 32;
            let q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
            let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
            let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
            y[l] = d * (sc[is] as i8) as f32 * q1 as f32;
            y[l + 32] = d * (sc[is + 2] as i8) as f32 * q2 as f32;
            y[l + 64] = d * (sc[is + 4] as i8) as f32 * q3 as f32;
            y[l + 96] = d * (sc[is + 6] as i8) as f32 * q4 as f32;
        }
        out.extend_from_slice(&y);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f16b(v: f32) -> [u8; 2] {
        f16::from_f32(v).to_le_bytes()
    }

    #[test]
    fn q4_0_and_q4_1_and_q8_0() {
        let mut block = Vec::new();
        block.extend(f16b(0.5));
        block.extend((0..16u8).map(|i| i | ((15 - i) << 4)));
        let mut out = Vec::new();
        dequantize(2, &block, &mut out);
        assert_eq!(out[0], -4.0); // (0 - 8) * 0.5
        assert_eq!(out[15], 3.5); // (15 - 8) * 0.5
        assert_eq!(out[16], 3.5); // high nibble of byte 0 = 15
        let mut block = Vec::new();
        block.extend(f16b(2.0));
        block.extend(f16b(-1.0));
        block.extend([0x31u8; 16]);
        out.clear();
        dequantize(3, &block, &mut out);
        assert_eq!((out[0], out[16]), (1.0, 5.0)); // 1*2-1, 3*2-1
        let mut block = Vec::new();
        block.extend(f16b(0.25));
        block.extend((0..32).map(|i| (i as i8 - 16) as u8));
        out.clear();
        dequantize(8, &block, &mut out);
        assert_eq!((out[0], out[31]), (-4.0, 3.75));
    }

    #[test]
    fn q5_0_uses_the_high_bits() {
        let mut block = Vec::new();
        block.extend(f16b(1.0));
        block.extend(0x0000_0001u32.to_le_bytes()); // element 0 has its 5th bit set
        block.extend([0u8; 16]);
        let mut out = Vec::new();
        dequantize(6, &block, &mut out);
        assert_eq!(out[0], 0.0); // (0 | 16) - 16
        assert_eq!(out[1], -16.0);
        assert_eq!(out.len(), 32);
    }

    #[test]
    fn k_quants_decode_a_known_block() {
        // Q4_K: d=1, dmin=0, all sub-block scales 1 (j<4 bytes 0..4 = 1; bytes 8..12 low nibble 1).
        let mut b = vec![0u8; 144];
        b[0..2].copy_from_slice(&f16b(1.0));
        b[2..4].copy_from_slice(&f16b(0.0));
        for j in 0..4 {
            b[4 + j] = 1;
        }
        for j in 8..12 {
            b[4 + j] = 1;
        }
        for (i, q) in b[16..144].iter_mut().enumerate() {
            *q = (i % 16) as u8 | 0x70;
        }
        let mut out = Vec::new();
        dequantize(12, &b, &mut out);
        assert_eq!(out.len(), 256);
        assert_eq!(out[0..4], [0.0, 1.0, 2.0, 3.0]);
        assert_eq!(out[32], 7.0); // high nibble, sub-block 1
        assert_eq!(out[255], 7.0);
        // Q6_K with d=1, scales 1, ql=qh=0 decodes to -32 everywhere.
        let mut b = vec![0u8; 210];
        for s in &mut b[192..208] {
            *s = 1;
        }
        b[208..210].copy_from_slice(&f16b(1.0));
        out.clear();
        dequantize(14, &b, &mut out);
        assert!(out.iter().all(|&v| v == -32.0) && out.len() == 256);
    }
}
