//! The font the figures' text is drawn in (plotters draws PNG text with a TrueType font).

use std::path::PathBuf;

use anyhow::{bail, Result};
use plotters::style::FontStyle;

/// Text in the PNG needs a TrueType font: `$VERDICT_FONT`, else a common system sans font.
pub(crate) fn register_font() -> Result<()> {
    static REGISTERED: std::sync::OnceLock<()> = std::sync::OnceLock::new();
    if REGISTERED.get().is_some() {
        return Ok(());
    }
    let candidates = std::env::var_os("VERDICT_FONT").map(PathBuf::from).into_iter().chain(
        [
            "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
            "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
            "/usr/share/fonts/TTF/DejaVuSans.ttf",
            "/usr/share/fonts/dejavu/DejaVuSans.ttf",
            "/Library/Fonts/Arial.ttf",
        ]
        .map(PathBuf::from),
    );
    let Some(bytes) = candidates.into_iter().find_map(|p| std::fs::read(p).ok()) else {
        bail!("no TrueType font for the figure's text: install fonts-dejavu-core, or set VERDICT_FONT to a .ttf file");
    };
    let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
    plotters::style::register_font("sans-serif", FontStyle::Normal, bytes)
        .map_err(|_| anyhow::anyhow!("the figure's font is not a TrueType font (VERDICT_FONT?)"))?;
    REGISTERED.set(()).ok();
    Ok(())
}
