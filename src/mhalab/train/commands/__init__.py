"""The commands that use a trained run: mhalab-eval (evaluate), mhalab-predict (predict), mhalab-ensemble
(ensemble)."""
