//! Arbitrary bytes into the batch decoder: it must return, never panic, and
//! never allocate more than the bounded declared length.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = logdex_log::validate_batch(data);
    let _ = logdex_log::decode_batch(data);
    let mut copy = data.to_vec();
    if copy.len() >= 8 {
        logdex_log::set_base_offset(&mut copy, 42);
        let _ = logdex_log::decode_batch(&copy);
    }
});
