//! Compaction filter of the data keyspace: drops entries of dead generations
//! and entries below their group's durable cleanup watermark.
//!
//! Filters only run during compactions, so reads check generation and
//! watermark themselves; the filter only reclaims space.

use crate::GroupId;
use crate::encoding::{decode_data_prefix, decode_offset};
use crate::groups::{FilterView, Registry};
use fjall::compaction::filter::{CompactionFilter, CompactionFilterResult, Context, Factory, ItemAccessor, Verdict};
use std::sync::Arc;

/// Installed on the data keyspace through `with_compaction_filter_factories`.
pub(crate) struct GenerationFilterFactory {
    registry: Arc<Registry>,
}

impl GenerationFilterFactory {
    pub(crate) fn new(registry: Arc<Registry>) -> Self {
        Self { registry }
    }
}

impl Factory for GenerationFilterFactory {
    fn name(&self) -> &str {
        "logdex-index-generations"
    }

    fn make_filter(&self, _ctx: &Context) -> Box<dyn CompactionFilter> {
        if self.registry.is_ready() {
            Box::new(GenerationFilter {
                registry: self.registry.clone(),
                cached_group: None,
                cached_view: FilterView::default(),
            })
        } else {
            // Compactions can start inside `Database::open`, before the meta
            // keyspace is loaded: then nothing is known to be dead.
            Box::new(KeepAll)
        }
    }
}

struct KeepAll;

impl CompactionFilter for KeepAll {
    fn filter_item(&mut self, _item: ItemAccessor<'_>, _ctx: &Context) -> CompactionFilterResult {
        Ok(Verdict::Keep)
    }
}

struct GenerationFilter {
    registry: Arc<Registry>,
    /// Keys arrive sorted by group: one registry look-up per group and compaction.
    cached_group: Option<GroupId>,
    cached_view: FilterView,
}

impl GenerationFilter {
    fn view(&mut self, group: GroupId) -> &FilterView {
        if self.cached_group != Some(group) {
            self.cached_view = self.registry.filter_view(group);
            self.cached_group = Some(group);
        }
        &self.cached_view
    }
}

impl CompactionFilter for GenerationFilter {
    fn filter_item(&mut self, item: ItemAccessor<'_>, _ctx: &Context) -> CompactionFilterResult {
        let Some((group, generation)) = decode_data_prefix(item.key()) else {
            return Ok(Verdict::Keep);
        };
        match self.view(group).watermark_of(generation) {
            // A dead generation is never read again (generations are never
            // reused and reads only look up live ones), so no tombstone is
            // needed: an older version this uncovers is dead as well.
            None => Ok(Verdict::Destroy),
            Some(0) => Ok(Verdict::Keep),
            Some(watermark) => {
                let value = item.value()?;
                match decode_offset(&value) {
                    // A tombstone, not Destroy: an older version of the same
                    // key in a lower level must stay shadowed.
                    Some(offset) if offset < watermark => Ok(Verdict::Remove),
                    _ => Ok(Verdict::Keep),
                }
            }
        }
    }
}
