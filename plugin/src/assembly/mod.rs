//! Assembly: the engine a config asks for, built from loaded models. Settings live in
//! [`crate::config`]; this is the one place that turns them into a judge stack
//! ([`stack`]), a proposer ([`proposers`]) with its verify-length policy ([`policy`]), and
//! the [`Engine`] over them (`verdict serve` and `verdict generate` run what it returns).

pub mod policy;
pub mod proposers;
pub mod stack;

use std::sync::Arc;

use anyhow::Result;

use crate::{
    config::{Config, ProposerKind},
    engine::{Engine, LoadedModels, Scheduling, SpeculativeSetup},
    metrics::Metrics,
    sv::policy::KeepsLearning,
};

/// The engine the config asks for (speculative with its judge stack, or plain), and its
/// proposer's verify-length policy when it has one.
pub async fn configured_engine(
    config: &Config,
    models: &LoadedModels,
    metrics: Arc<Metrics>,
) -> Result<(Engine, Option<Arc<dyn KeepsLearning>>)> {
    let s = &config.speculative;
    if s.enabled {
        let stack = models.configured_stack(config)?;
        let scheduling = Scheduling::from(&config.server);
        let setup = move |gamma| SpeculativeSetup {
            gamma,
            stack,
            seed: s.seed,
            metrics,
            scheduling,
        };
        match s.proposer {
            ProposerKind::DraftModel => match models
                .draft_model_policy(config, &config.eagle_drafting())?
            {
                Some(policy) => {
                    let engine =
                        Engine::speculative_under(models, policy.clone(), setup(s.gamma)).await?;
                    Ok((engine, Some(policy)))
                }
                None => Ok((Engine::speculative(models, setup(s.gamma)).await?, None)),
            },
            ProposerKind::Eagle => {
                let proposer = models.eagle_proposer(config)?;
                let engine =
                    Engine::with_proposer(models, proposer.clone(), setup(s.gamma)).await?;
                Ok((engine, Some(proposer)))
            }
            ProposerKind::Ngram => {
                let proposer = models.ngram_proposer(config)?;
                let engine =
                    Engine::with_proposer(models, proposer.clone(), setup(s.ngram_gamma)).await?;
                Ok((engine, Some(proposer)))
            }
            ProposerKind::NgramEagle => {
                let drafting = config.eagle_drafting();
                let head = models.eagle_head(config, None, &drafting)?;
                let proposer = models.combined_proposer(config, head, s.gamma, &drafting)?;
                let gamma = proposer.proposer().gamma();
                let engine = Engine::with_proposer(models, proposer.clone(), setup(gamma)).await?;
                Ok((engine, Some(proposer)))
            }
        }
    } else {
        Ok((Engine::plain(models, &config.server).await, None))
    }
}
