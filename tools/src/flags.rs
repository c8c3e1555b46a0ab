//! Bounded integer flags: every count or size a flag gives is checked by the parser against a
//! range before anything is allocated from it, so `--partitions 18446744073709551615` is a
//! usage error (exit 2) that names the flag, not a "capacity overflow" panic.

/// A `clap` value parser for an integer in `lo..=hi`.
///
/// ```
/// let parse = mpipemoe_tools::flags::count(1, 16);
/// assert_eq!(parse("4"), Ok(4));
/// assert!(parse("17").unwrap_err().contains("1..=16"));
/// assert!(parse("-1").is_err());
/// ```
pub fn count(lo: usize, hi: usize) -> impl Fn(&str) -> Result<usize, String> + Clone + Send + Sync + 'static {
    move |text: &str| {
        let value: u128 = text
            .trim()
            .parse()
            .map_err(|_| format!("must be a whole number in {lo}..={hi}"))?;
        match usize::try_from(value) {
            Ok(v) if (lo..=hi).contains(&v) => Ok(v),
            _ => Err(format!("must be in {lo}..={hi}")),
        }
    }
}

/// A `clap` value parser for one token id of a comma-separated list (`--ids 1, 5, 9` as
/// well as `--ids 1,5,9`): a whole number, spaces around it ignored. Whether the model has
/// the id is the model's check.
///
/// ```
/// let parse = mpipemoe_tools::flags::token_id;
/// assert_eq!(parse(" 5"), Ok(5));
/// assert!(parse("").unwrap_err().contains("token id"));
/// assert!(parse("-1").is_err() && parse("1.5").is_err());
/// ```
pub fn token_id(text: &str) -> Result<usize, String> {
    text.trim()
        .parse()
        .map_err(|_| format!("`{text}` is not a token id (a whole number >= 0)"))
}

/// A `clap` value parser for one name of a comma-separated list (`--lora-targets q_proj,
/// v_proj`): spaces around it ignored, an empty one refused.
///
/// ```
/// let parse = mpipemoe_tools::flags::name;
/// assert_eq!(parse(" v_proj"), Ok("v_proj".to_string()));
/// assert!(parse(" ").unwrap_err().contains("empty"));
/// ```
pub fn name(text: &str) -> Result<String, String> {
    match text.trim() {
        "" => Err("an empty name in the list".into()),
        name => Ok(name.to_string()),
    }
}

/// A `clap` value parser for a byte count: a whole number of bytes, or a number (a decimal
/// fraction allowed) with a unit, `kB`, `MB`, `GB`, `TB` in powers of 1000 or `KiB`, `MiB`,
/// `GiB`, `TiB` in powers of 1024 (the unit's case does not matter; `B` alone is bytes). A
/// fraction of a byte is dropped; more than the address space holds is refused.
///
/// ```
/// let parse = mpipemoe_tools::flags::bytes;
/// assert_eq!(parse("85899345920"), Ok(85_899_345_920));
/// assert_eq!(parse("80GiB"), Ok(80 << 30));
/// assert_eq!(parse("1.5 GB"), Ok(1_500_000_000));
/// assert_eq!(parse("512mib"), Ok(512 << 20));
/// assert!(parse("80 GiB of it").unwrap_err().contains("unit"));
/// assert!(parse("-1GB").is_err() && parse("NaN").is_err() && parse("1e3GB").is_err());
/// assert!(parse("99999999TiB").unwrap_err().contains("more than"));
/// ```
pub fn bytes(text: &str) -> Result<usize, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(text.len());
    let (number, unit) = (&text[..split], text[split..].trim());
    const FORMS: &str = "a byte count: a whole number of bytes, or a number with a unit \
                         (kB, MB, GB, TB; KiB, MiB, GiB, TiB), e.g. 80GiB";
    let scale: u64 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        "kib" => 1 << 10,
        "mib" => 1 << 20,
        "gib" => 1 << 30,
        "tib" => 1 << 40,
        _ => return Err(format!("`{unit}` is not a unit; give {FORMS}")),
    };
    let too_many = || format!("{text} is more than this machine can address");
    let value = match number.split_once('.') {
        None => number
            .parse::<u128>()
            .map_err(|_| format!("must be {FORMS}"))?
            .checked_mul(scale as u128)
            .ok_or_else(too_many)?,
        Some((_, frac)) if number != "." && !frac.contains('.') => {
            // Whole bytes of a fraction: the number is parsed whole, then scaled and cut.
            let v: f64 = number.parse().map_err(|_| format!("must be {FORMS}"))?;
            let scaled = v * scale as f64;
            if !scaled.is_finite() || scaled >= u128::MAX as f64 {
                return Err(too_many());
            }
            scaled.floor() as u128
        }
        Some(_) => return Err(format!("must be {FORMS}")),
    };
    usize::try_from(value).map_err(|_| too_many())
}

/// A `clap` value parser for a finite number ≥ 0 (a rate, a speed, a weight).
///
/// ```
/// let parse = mpipemoe_tools::flags::non_negative;
/// assert_eq!(parse("0.001"), Ok(0.001));
/// assert!(parse("-1").unwrap_err().contains(">= 0"));
/// assert!(parse("inf").is_err() && parse("NaN").is_err());
/// ```
pub fn non_negative(text: &str) -> Result<f64, String> {
    match text.trim().parse::<f64>() {
        Ok(v) if v.is_finite() && v >= 0.0 => Ok(v),
        _ => Err("must be a finite number >= 0".into()),
    }
}

/// A `clap` value parser for a finite number > 0 (a temperature).
///
/// ```
/// let parse = mpipemoe_tools::flags::positive;
/// assert_eq!(parse("0.7"), Ok(0.7));
/// assert!(parse("0").unwrap_err().contains("> 0"));
/// assert!(parse("NaN").is_err());
/// ```
pub fn positive(text: &str) -> Result<f64, String> {
    match text.trim().parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 => Ok(v),
        _ => Err("must be a finite number > 0".into()),
    }
}

/// A `clap` value parser for a probability mass in `(0, 1]` (top-p).
///
/// ```
/// let parse = mpipemoe_tools::flags::mass;
/// assert_eq!(parse("0.9"), Ok(0.9));
/// assert!(parse("0").unwrap_err().contains("(0, 1]"));
/// assert!(parse("1.5").is_err());
/// ```
pub fn mass(text: &str) -> Result<f64, String> {
    match text.trim().parse::<f64>() {
        Ok(v) if v > 0.0 && v <= 1.0 => Ok(v),
        _ => Err("must be a number in (0, 1]".into()),
    }
}

/// `--shadowing`: `off`, `auto` (the cost model's choice each step) or a count `k` (the `k`
/// most loaded experts each step, 1..=65536).
///
/// ```
/// use mpipemoe::Shadowing;
/// use mpipemoe_tools::flags::shadowing;
/// assert_eq!(shadowing("auto").unwrap(), Shadowing::Auto);
/// assert_eq!(shadowing("2").unwrap(), Shadowing::Fixed(2));
/// assert!(shadowing("0").unwrap_err().contains("off"));
/// ```
pub fn shadowing(text: &str) -> Result<mpipemoe::Shadowing, String> {
    match text.trim() {
        "off" => Ok(mpipemoe::Shadowing::Off),
        "auto" => Ok(mpipemoe::Shadowing::Auto),
        other => count(1, 65536)(other)
            .map(mpipemoe::Shadowing::Fixed)
            .map_err(|e| format!("expected off, auto or a count of experts ({e})")),
    }
}

/// Writing to `path` needs `--overwrite` if it exists: say so before any work is done.
///
/// # Errors
/// A one-line message naming the path and the flag.
pub fn may_write(path: &std::path::Path, overwrite: bool) -> Result<(), String> {
    if !overwrite && std::fs::symlink_metadata(path).is_ok() {
        return Err(format!(
            "{} exists; give --overwrite to replace it",
            path.display()
        ));
    }
    Ok(())
}

/// `--executor`: how the exchange runs its schedule.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExecutorArg {
    /// The backend's default (`MoeBackend::step_executor`).
    Default,
    /// One thread per stream.
    Threads,
    /// Issue order on the calling thread.
    InOrder,
}

impl ExecutorArg {
    /// The layer config's value: `None` leaves the choice to the backend.
    pub fn executor(self) -> Option<mpipemoe::backend::StepExecutor> {
        use mpipemoe::backend::StepExecutor;
        match self {
            ExecutorArg::Default => None,
            ExecutorArg::Threads => Some(StepExecutor::StreamThreads),
            ExecutorArg::InOrder => Some(StepExecutor::InOrder),
        }
    }
}
