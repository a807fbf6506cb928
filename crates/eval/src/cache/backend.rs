//! [`KvCache`] as a [`KvBackend`]: rows appended per layer in steps
//! (committed, rolled back or cut back), and attention over the layer as
//! stored, encoded and faulted again on each call (the paper's protocol).

use super::*;

impl KvBackend for KvCache {
    type Error = kv_model::ModelError;

    /// Sizes the cache for a model on first use; refuses another model's
    /// shape, forms that name layers the model lacks, and forms whose
    /// codebooks the calibration does not hold.
    fn fit(&mut self, model: &ModelKvShape<'_>) -> std::result::Result<(), kv_model::ModelError> {
        if self.rows.layers() == 0 {
            if let CacheMode::Stored(stored) = &self.mode {
                self.codes = resolve(stored, model.layers, model.heads.kv_channels())?;
                for c in &self.codes {
                    check_layer_forms(c.key.form, c.value.form, model.rope.is_some())?;
                }
                if let Some(blocks) = &stored.blocks {
                    let forms: Vec<_> = self
                        .codes
                        .iter()
                        .map(|c| [c.key.form, c.value.form])
                        .collect();
                    blocks.check(&forms)?;
                }
            }
            self.rope = model.rope.cloned();
        }
        Ok(self.rows.fit(model)?)
    }

    fn tokens(&self) -> usize {
        self.rows.tokens()
    }

    fn begin(&mut self, tokens: &[u32]) -> std::result::Result<(), kv_model::ModelError> {
        self.rows.begin(tokens)?;
        self.checkpoint = Some(self.stats.clone());
        Ok(())
    }

    fn append(
        &mut self,
        layer: usize,
        keys: &[f32],
        values: &[f32],
    ) -> std::result::Result<(), kv_model::ModelError> {
        Ok(self.rows.append(layer, keys, values)?)
    }

    fn commit(&mut self) -> std::result::Result<(), kv_model::ModelError> {
        // A refused step is rolled back by the rows; its statistics here.
        if let Err(e) = self.rows.commit() {
            self.rollback();
            return Err(e.into());
        }
        self.calls += 1;
        self.checkpoint = None;
        self.prefill.get_or_insert(self.rows.tokens());
        Ok(())
    }

    /// Drops the step's rows and the statistics its attention calls added.
    fn rollback(&mut self) {
        self.rows.rollback();
        if self.prefill.is_none() {
            self.windows.clear();
        }
        // Chunks folded during the step came from its rows, now gone.
        for state in &mut self.windows {
            state.rollback();
        }
        if let Some(stats) = self.checkpoint.take() {
            self.stats = stats;
        }
    }

    /// Commits the first `keep` rows of the step (the default: commit,
    /// then cut back), except that shard forms, which cannot be cut back,
    /// refuse to keep fewer than all and roll the step back.
    fn commit_prefix(&mut self, keep: usize) -> std::result::Result<(), kv_model::ModelError> {
        let channels = self.rows.channels().max(1);
        let held = self.rows.rows(0).map_or(0, |(k, _)| k.len() / channels);
        let step = held.saturating_sub(self.rows.tokens());
        if keep < step && self.has_shard_forms() {
            self.rollback();
            return Err(shard_cut_back().into());
        }
        attention::commit_then_truncate(self, keep)
    }

    /// Drops committed tokens past `tokens` (the stored forms are encoded
    /// again from the rows on every call, so nothing else changes).
    /// Refused for shard forms, whose state is built at the prefill.
    fn truncate(&mut self, tokens: usize) -> std::result::Result<(), kv_model::ModelError> {
        if self.has_shard_forms() && tokens < self.rows.tokens() {
            return Err(shard_cut_back().into());
        }
        self.rows.truncate(tokens)?;
        if tokens == 0 {
            self.prefill = None;
        }
        Ok(())
    }

    /// Attends `layer` over its rows as stored: in [`CacheMode::Stored`]
    /// the whole layer is quantised, encoded and faulted again on each call
    /// (the paper's protocol).
    fn attend(
        &mut self,
        layer: usize,
        attention: &Attention,
        queries: &[f32],
        positions: &[usize],
        mask: &Mask<'_>,
    ) -> std::result::Result<AttentionOutput, kv_model::ModelError> {
        let out = match &self.mode {
            CacheMode::Plain => self
                .rows
                .attend(layer, attention, queries, positions, mask)?,
            CacheMode::Stored(_) => {
                let (k, v) = self
                    .rows
                    .rows(layer)
                    .ok_or_else(|| EvalError::InvalidParameter {
                        name: "layer",
                        reason: format!("layer {layer} of a cache of {} layers", self.codes.len()),
                    })?;
                let ch = self.rows.channels();
                let tokens = k.len() / ch;
                let rope = self.rope.as_ref();
                let codes = &self.codes[layer];
                let head_dim = attention.shape().head_dim();
                let blocks = match &self.mode {
                    CacheMode::Stored(s) => s.blocks.as_deref(),
                    CacheMode::Plain => None,
                };
                if self.windows.len() <= layer {
                    self.windows.resize(layer + 1, WindowState::default());
                }
                let mut read = match blocks {
                    Some(b) => {
                        let part = |code: &PartCode, rows: &[f32], part: usize| {
                            BlockedPart::build(b, (layer, part, code.form), rows, tokens, ch)
                        };
                        ReadLayer::Blocked([part(&codes.key, k, 0)?, part(&codes.value, v, 1)?])
                    }
                    None => ReadLayer::Window(open_window_layer(
                        [
                            (codes.key.form, &codes.key.fitted),
                            (codes.value.form, &codes.value.fitted),
                        ],
                        &mut self.windows[layer],
                        (k, v),
                        WindowShape {
                            tokens,
                            prefill: self.prefill.unwrap_or(tokens),
                            channels: ch,
                            head_dim,
                        },
                        rope,
                    )?),
                };
                let bytes = read.bytes();
                self.stats.stored_bytes += bytes.total;
                self.stats.codebook_bytes += bytes.shared;
                self.stats.part_bytes[0] += bytes.parts[0];
                self.stats.part_bytes[1] += bytes.parts[1];
                self.stats.stored_values += 2 * (tokens * ch) as u64;
                // The stores' fault ledgers record every flip: attention
                // reads the faulted stores through the same fused kernels as
                // clean ones, and the statistics still separate corrected,
                // miscorrected and silent words.
                if let Some(faults) = &self.faults {
                    let base = mix(faults.spec.seed ^ mix(self.stream ^ mix(self.calls)));
                    let seed = |part: usize| mix(base ^ mix((2 * layer + part) as u64));
                    let part_faults = |part: usize| PartFaults {
                        faults,
                        layer,
                        part,
                        seed: seed(part),
                        block: blocks.map(|b| b.block),
                    };
                    let injected = read.inject(faults, layer, [seed(0), seed(1)], part_faults)?;
                    self.stats.injected_flips += injected.flips;
                    self.stats.tables += injected.tables;
                }
                if let (ReadLayer::Blocked(parts), Some(b)) = (&read, blocks)
                    && b.observe
                {
                    if self.stats.blocks.len() < 2 * (layer + 1) {
                        self.stats.blocks.resize(2 * (layer + 1), Vec::new());
                    }
                    for (part, read) in parts.iter().enumerate() {
                        read.observe(&mut self.stats.blocks[2 * layer + part])?;
                    }
                }
                let out = match &read {
                    ReadLayer::Window(w) => w.attend(attention, queries, positions, mask)?,
                    ReadLayer::Blocked([bk, bv]) => {
                        attention.prefill(queries, positions, bk, bv, mask)?
                    }
                };
                let [read_k, read_v] = read.low_rank();
                if read_k.is_some() || read_v.is_some() {
                    let value_norm = if read_v.is_some() {
                        0.0
                    } else {
                        max_head_norm(v, head_dim)
                    };
                    let certs = certificates(
                        attention.shape(),
                        queries,
                        positions,
                        tokens,
                        read_k,
                        read_v,
                        value_norm,
                        mask,
                    )?;
                    if self.stats.certificates.len() <= layer {
                        self.stats
                            .certificates
                            .resize(layer + 1, CertificateSums::default());
                    }
                    let sums = &mut self.stats.certificates[layer];
                    for c in certs {
                        sums.count += 1;
                        sums.logit_sum += f64::from(c.logit);
                        sums.logit_max = sums.logit_max.max(f64::from(c.logit));
                        sums.output_sum += f64::from(c.output);
                        sums.output_max = sums.output_max.max(f64::from(c.output));
                    }
                }
                out
            }
        };
        self.stats.keys += out.stats.keys;
        self.stats.values += out.stats.values;
        if self.stats.layers.len() <= layer {
            self.stats
                .layers
                .resize(layer + 1, LayerCodewords::default());
        }
        let seen = &mut self.stats.layers[layer];
        for s in [out.stats.keys.values, out.stats.values.values] {
            *seen += LayerCodewords::of(&s);
        }
        self.stats.non_finite += out.non_finite as u64;
        Ok(out)
    }
}

impl KvCache {
    /// Whether a layer keeps a part in a form whose state is fitted at
    /// the prefill (a shard form).
    fn has_shard_forms(&self) -> bool {
        self.codes
            .iter()
            .any(|c| keeps_prefill(c.key.form) || keeps_prefill(c.value.form))
    }
}

/// The refusal to cut back a cache of shard forms.
fn shard_cut_back() -> EvalError {
    EvalError::InvalidParameter {
        name: "truncate",
        reason: "shard forms fit their state at the prefill; their cache cannot be cut back \
                 (speculative decoding needs another form)"
            .into(),
    }
}
