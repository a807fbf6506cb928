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
            self.shard.clear();
        }
        // Chunks folded during the step came from its rows, now gone.
        for slot in self.shard.iter_mut().flatten() {
            slot.grown = None;
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
                if codes.key.form.quantizer().is_shard() || codes.value.form.quantizer().is_shard()
                {
                    let faults = self.faults.as_ref().map(|f| {
                        let base = mix(f.spec.seed ^ mix(self.stream ^ mix(self.calls)));
                        let seed = mix(base ^ mix(2 * layer as u64));
                        (f.layer_channel(layer), seed, f.spec.target)
                    });
                    let prefill = self.prefill.unwrap_or(tokens);
                    let run = shard::attend(
                        &mut self.shard,
                        layer,
                        codes,
                        prefill,
                        rope,
                        (k, v, tokens),
                        attention,
                        (queries, positions, mask),
                        faults,
                    )?;
                    let b = run.bytes;
                    self.stats.stored_bytes += b.total() as u64;
                    self.stats.part_bytes[0] += (b.keys + (b.exact + b.stream) / 2) as u64;
                    self.stats.part_bytes[1] += (b.values + (b.exact + b.stream) / 2) as u64;
                    self.stats.stored_values += 2 * (tokens * ch) as u64;
                    self.stats.injected_flips += run.flips;
                    self.stats.tables += run.tables;
                    run.out
                } else {
                    let blocks = match &self.mode {
                        CacheMode::Stored(s) => s.blocks.as_deref(),
                        CacheMode::Plain => None,
                    };
                    let build = |code: &PartCode, rows: &[f32], part: usize| match blocks {
                        Some(b) => Ok(StoredPart::Blocked(BlockedPart::build(
                            b,
                            (layer, part, code.form),
                            rows,
                            tokens,
                            ch,
                        )?)),
                        None => StoredPart::build(code, rows, tokens, ch, head_dim, rope),
                    };
                    let mut read_k = build(&codes.key, k, 0)?;
                    let mut read_v = build(&codes.value, v, 1)?;
                    for (part, i) in [(&read_k, 0), (&read_v, 1)] {
                        let (own, shared) = part.bytes();
                        self.stats.stored_bytes += own + shared;
                        self.stats.codebook_bytes += shared;
                        self.stats.part_bytes[i] += own + shared;
                    }
                    self.stats.stored_values += 2 * (tokens * ch) as u64;
                    // The stores' fault ledgers record every flip: attention
                    // reads the faulted stores through the same fused kernels as
                    // clean ones, and the statistics still separate corrected,
                    // miscorrected and silent words.
                    if let Some(faults) = &self.faults {
                        let base = mix(faults.spec.seed ^ mix(self.stream ^ mix(self.calls)));
                        let parts = [&codes.key, &codes.value];
                        for (part, read) in [&mut read_k, &mut read_v].into_iter().enumerate() {
                            let part_faults = PartFaults {
                                faults,
                                layer,
                                part,
                                seed: mix(base ^ mix((2 * layer + part) as u64)),
                                block: blocks.map(|b| b.block),
                            };
                            self.stats.injected_flips += read.inject(&part_faults)?;
                            let (flips, tables) = read.inject_tables(parts[part], &part_faults)?;
                            self.stats.injected_flips += flips;
                            self.stats.tables += tables;
                        }
                    }
                    if blocks.is_some_and(|b| b.observe) {
                        if self.stats.blocks.len() < 2 * (layer + 1) {
                            self.stats.blocks.resize(2 * (layer + 1), Vec::new());
                        }
                        for (part, read) in [&read_k, &read_v].into_iter().enumerate() {
                            if let StoredPart::Blocked(b) = read {
                                b.observe(&mut self.stats.blocks[2 * layer + part])?;
                            }
                        }
                    }
                    let (read_k, read_v) = (&read_k, &read_v);
                    let out = match coefficient_path(read_k, read_v) {
                        Some((ks, vs)) => {
                            attention.attend_low_rank(queries, positions, ks, vs, mask)?
                        }
                        None => {
                            let keys = Source::of(read_k, rope);
                            let values = Source::of(read_v, None);
                            attention.prefill(queries, positions, &keys, &values, mask)?
                        }
                    };
                    if read_k.low_rank().is_some() || read_v.low_rank().is_some() {
                        let value_norm = if read_v.low_rank().is_some() {
                            0.0
                        } else {
                            max_head_norm(v, head_dim)
                        };
                        let certs = certificates(
                            attention.shape(),
                            queries,
                            positions,
                            tokens,
                            read_k.low_rank(),
                            read_v.low_rank(),
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
    /// Whether a layer keeps a part in a shard form.
    fn has_shard_forms(&self) -> bool {
        self.codes
            .iter()
            .any(|c| c.key.form.quantizer().is_shard() || c.value.form.quantizer().is_shard())
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
