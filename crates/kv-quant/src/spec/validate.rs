//! The checks every [`CacheForm`] passes when it is built or parsed
//! (`CacheForm::validate`): one place that refuses contradictory
//! combinations, so every `CacheForm` value is valid.

use super::*;

impl CacheForm {
    pub(super) fn validate(&self) -> std::result::Result<(), String> {
        let positive = |what: &str, n: usize| {
            if n == 0 {
                Err(format!("{what} must be at least 1"))
            } else {
                Ok(())
            }
        };
        match self.quantizer {
            Quantizer::Int(s) => {
                if ![2, 3, 4, 8].contains(&s.bits) {
                    return Err(format!(
                        "int{} is not supported (2, 3, 4 or 8 bits)",
                        s.bits
                    ));
                }
                match s.granularity {
                    Granularity::PerToken { group: Some(g) } => positive("group size", g)?,
                    Granularity::PerChannel { tokens: Some(t) } => positive("token block", t)?,
                    _ => {}
                }
            }
            Quantizer::Hierarchical(s) => {
                if s.bits != 4 {
                    return Err(format!(
                        "a hierarchical form keeps two 4-bit planes, not {}-bit ones",
                        s.bits
                    ));
                }
                match s.granularity {
                    Granularity::PerToken { group: Some(g) } => positive("group size", g)?,
                    Granularity::PerChannel { tokens: Some(t) } => positive("token block", t)?,
                    Granularity::PerTensor => {
                        return Err("int8h planes are kept in paged blocks: per-token or \
                                    per-channel groups, not one scale per tensor (-t)"
                            .into());
                    }
                    _ => {}
                }
                if self.rotation.is_some() {
                    return Err(
                        "int8h keeps its planes in the rows' own coordinates and takes \
                                no +rot"
                            .into(),
                    );
                }
            }
            Quantizer::Nf4(s) => positive("group size", s.group)?,
            Quantizer::Fp8(Fp8Spec {
                head_dim: Some(h), ..
            }) => positive("head dimension", h)?,
            Quantizer::LloydMax(s) => {
                if !(1..=8).contains(&s.bits) {
                    return Err(format!("lm{} is not supported (1 to 8 bits)", s.bits));
                }
                if s.qjl && s.bits == 8 {
                    return Err("+qjl adds a bit to the code: lm1 to lm7 only".into());
                }
            }
            Quantizer::LowRank(s) => {
                match s.method {
                    LowRankMethod::Pca(RankRule::Fixed(r)) => positive("rank", r)?,
                    LowRankMethod::Pca(RankRule::Energy(e)) => {
                        if e == 0 || e > 1_000_000 {
                            return Err(format!(
                                "retained energy {} is not in (0, 1]",
                                e as f64 / 1e6
                            ));
                        }
                    }
                    LowRankMethod::Fd {
                        rank,
                        sketch,
                        chunk,
                        threshold,
                    } => {
                        positive("rank", rank)?;
                        positive("chunk length", chunk)?;
                        if sketch < 2 * rank {
                            return Err(format!(
                                "a sketch of {sketch} rows is below twice the rank {rank}"
                            ));
                        }
                        if threshold == 0 {
                            return Err("the residual threshold must be positive".into());
                        }
                    }
                }
                if self.rotation.is_some() || !self.segments.is_empty() {
                    return Err("low-rank forms take no +rot, +sink or +win".into());
                }
            }
            Quantizer::Shard(s) => {
                s.check()?;
                if self.rotation.is_some() {
                    return Err("shard rotates its values itself and takes no +rot".into());
                }
                if self.segments.sink == 0 {
                    return Err("shard keeps at least one sink token exact".into());
                }
                if let Some(p) = &self.protection
                    && p.policy != ErasurePolicy::Keep
                {
                    return Err(
                        "shard keeps the received codes of detected words (+keep): a code \
                         covers coefficients and indices, not values to zero or interpolate"
                            .into(),
                    );
                }
            }
            Quantizer::Vq(s) => {
                if ![1, 2, 4, 8].contains(&s.dim) {
                    return Err(format!(
                        "{} codes of {} channels are not supported (1, 2, 4 or 8)",
                        if s.coupled { "cq" } else { "vq" },
                        s.dim
                    ));
                }
                if !s.centroids.is_power_of_two() || !(2..=256).contains(&s.centroids) {
                    return Err(format!(
                        "a codebook of {} centroids is not supported (a power of two from 2 to 256)",
                        s.centroids
                    ));
                }
                if s.gain_block.is_some() && !s.coupled {
                    return Err(
                        "a vq form's gain block is its rotation block (+rot<N>); only cq \
                         takes a gain block of its own"
                            .into(),
                    );
                }
                if let Some(g) = s.gain_block
                    && (g == 0 || !g.is_multiple_of(s.dim))
                {
                    return Err(format!(
                        "a gain block of {g} channels is not whole codes of {} channels",
                        s.dim
                    ));
                }
                if s.pre_rope && (!s.coupled || s.dim != 2) {
                    return Err(
                        "-pre codes each rotated pair of a key on its own codebook: spell it \
                         with cq-d2 (one code per pair)"
                            .into(),
                    );
                }
                if s.coupled && self.rotation.is_some() {
                    return Err(
                        "cq codes the channels as they are, each group with its own codebook, \
                         and takes no +rot (vq rotates)"
                            .into(),
                    );
                }
            }
            _ => {}
        }
        match self.rotation {
            Some(r) => {
                if self.quantizer.is_float() {
                    return Err(format!(
                        "+rot rotates codes that round; {} stores the values as they are",
                        parse::base_name(&self.quantizer)
                    ));
                }
                if !r.block.is_power_of_two() || !(2..=MAX_ROTATION_BLOCK).contains(&r.block) {
                    return Err(format!(
                        "rotation block {} is not a power of two from 2 to {MAX_ROTATION_BLOCK}",
                        r.block
                    ));
                }
                if let Quantizer::Vq(s) = self.quantizer
                    && !r.block.is_multiple_of(s.dim)
                {
                    return Err(format!(
                        "vq codes of {} channels do not divide rotation blocks of {}",
                        s.dim, r.block
                    ));
                }
            }
            None if self.quantizer.needs_rotation() => {
                return Err(format!(
                    "{} quantizes rotated coordinates and needs a rotation",
                    parse::base_name(&self.quantizer)
                ));
            }
            None => {}
        }
        if !self.segments.is_empty() && self.quantizer.is_float() {
            return Err(format!(
                "+sink/+win keep tokens exact; {} keeps every token as it is",
                parse::base_name(&self.quantizer)
            ));
        }
        if let Some(p) = &self.protection
            && let ErasurePolicy::Interpolate { reach: 0 } = p.policy
        {
            return Err("interpolation reach must be at least 1".into());
        }
        if let Some(share) = self.sparse {
            SparseSpec::new(share.basis_points).map_err(|e| e.to_string())?;
            match self.quantizer {
                Quantizer::Int(IntSpec {
                    granularity: Granularity::PerTensor,
                    ..
                }) => {
                    return Err(
                        "+out splits each block's groups; one scale per tensor (-t) \
                                has no groups to split"
                            .into(),
                    );
                }
                Quantizer::Int(s) if s.symmetric && share.clip() => {
                    return Err("+clip searches an asymmetric range (offset and scale): \
                                drop -sym or +clip"
                        .into());
                }
                Quantizer::Int(_) => {}
                other => {
                    return Err(format!(
                        "+out keeps the outliers of an integer form's groups exact \
                         (int2, int3, int4, int8 with -ch or per-token groups), not of {}",
                        parse::base_name(&other)
                    ));
                }
            }
            if self.rotation.is_some() {
                return Err("+out keeps values exact in the rows' own coordinates and \
                            takes no +rot"
                    .into());
            }
            if self.segments.window != 0 {
                return Err("+out seals blocks as their tokens arrive; a recent window \
                            (+win) is not kept beside it yet"
                    .into());
            }
        }
        Ok(())
    }
}
