//! A model whose weights do not fit the memory budget is refused before
//! any tensor is read (its own test binary: the budget is set once per
//! process).

mod common;

#[test]
fn weights_past_the_budget_are_refused_at_load() {
    let bytes = common::tiny::tiny_gguf();
    let path = std::env::temp_dir().join(format!("kv-eval-budget-{}.gguf", std::process::id()));
    std::fs::write(&path, &bytes).unwrap();
    // The tiny model (about 90 KB of tensors) loads in the other tests.
    assert!(kv_eval::budget::set_limit(1024));
    let err = match kv_eval::load::load_model(&path) {
        Ok(_) => panic!("a model past the budget loaded"),
        Err(e) => e.to_string(),
    };
    std::fs::remove_file(&path).unwrap();
    assert!(err.contains("the weights of"), "{err}");
}
