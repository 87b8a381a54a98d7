"""Makes tests/data/run_e577ba4: a small translation run as e577ba4 wrote it.

Run once, at commit e577ba4, from the project's root:

    git worktree add /tmp/e577ba4 e577ba4
    cp tests/data/run_e577ba4/make.py /tmp/e577ba4/
    cd /tmp/e577ba4 && python make.py OUT

and copy OUT into tests/data/run_e577ba4. It is the golden layout that later
versions must still resume, load and translate (tests/test_golden_run.py):
never regenerate it with newer code, or it proves nothing.

What it writes:
  data/       a synthetic parallel corpus (pseudo-words, two 'languages' that
              differ in their words and word order): not Multi30k, so it
              can be committed, and the test needs no downloaded data.
  workdir/    the finished run (200 steps, 2 micro-batches per update, so the
              optimizer state is e577ba4's optax.MultiSteps layout), less what
              it can make again (tfds/, tensorboard/, the pictures).
  expected.json  what e577ba4 made of it: the translate command's output on
              the test sources, with the best, latest and averaged
              parameters; and the run resumed for two steps from a copy of
              workdir/, logging each: its losses (the first is the restored
              parameters', the second follows the restored Adam state's
              update) and its translations.
"""

import json
import os
import random
import shutil
import subprocess
import sys
import tempfile

SYLLABLES = ('ka ke ki ko ku ma me mi mo mu na ne ni no nu ra re ri ro ru '
             'sa se si so su ta te ti to tu la le li lo lu pa pe pi po pu '
             'ba be bi bo bu da de di do du').split()
FLAGS = ['--task=translate', '--config=translate', '--src_lang=de',
         '--tgt_lang=en', '--src_vocab_size=300', '--tgt_vocab_size=300',
         '--d_model=32', '--d_ff=64', '--num_heads=4',
         '--num_encoder_layers=1', '--num_decoder_layers=1', '--max_len=48',
         '--tokens_per_batch=1536', '--warmup_steps=50', '--train_steps=200',
         '--log_every=20', '--eval_every=200', '--checkpoint_every=50',
         '--eval_beam_size=2', '--average_last=2', '--eval_alpha=0.8',
         '--grad_accumulation=2', '--keep_checkpoints=2']


def write_corpus(directory: str) -> None:
  """train (400 pairs), val (20) and test_2016_flickr (20), de and en."""
  rng = random.Random(577)
  def word():
    return ''.join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 3)))
  de = [word() for _ in range(300)]
  en = [word() for _ in range(300)]
  os.makedirs(directory)
  for split, count in (('train', 400), ('val', 20), ('test_2016_flickr', 20)):
    pairs = []
    for _ in range(count):
      concepts = [rng.randrange(300) for _ in range(rng.randint(3, 10))]
      # 'en' puts the last concept first: a reordering to learn.
      pairs.append((' '.join(de[c] for c in concepts),
                    ' '.join(en[c] for c in concepts[-1:] + concepts[:-1])))
    for index, lang in enumerate(('de', 'en')):
      with open(os.path.join(directory, f'{split}.{lang}'), 'w',
                encoding='utf-8') as f:
        f.write(''.join(pair[index] + '\n' for pair in pairs))


def translate(workdir: str, source: str, params: str) -> list[str]:
  return subprocess.run(
      [sys.executable, '-m', 'flaxformer_mini.translate', f'--workdir={workdir}',
       f'--input={source}', f'--params={params}'], check=True,
      capture_output=True, text=True).stdout.splitlines()


def main(out: str) -> None:
  data = os.path.join(out, 'data')
  write_corpus(data)
  with tempfile.TemporaryDirectory() as scratch:
    run = os.path.join(scratch, 'run')
    subprocess.run([sys.executable, 'train.py', *FLAGS, f'--workdir={run}',
                    f'--data_dir={data}'], check=True)
    workdir = os.path.join(out, 'workdir')
    shutil.copytree(run, workdir, ignore=shutil.ignore_patterns(
        'tfds', 'tensorboard', '*.png', '.lock'))
    test = os.path.join(data, 'test_2016_flickr.de')
    expected = {'commit': 'e577ba4', 'flags': FLAGS,
                'translations': {which: translate(workdir, test, which)
                                 for which in ('best', 'latest', 'averaged')}}
    resumed = os.path.join(scratch, 'resumed')
    shutil.copytree(workdir, resumed)
    subprocess.run([sys.executable, 'train.py', *FLAGS, '--train_steps=202',
                    '--log_every=1',
                    f'--workdir={resumed}', f'--data_dir={data}'], check=True)
    with open(os.path.join(resumed, 'results.json'), encoding='utf-8') as f:
      results = json.load(f)
    expected['resumed'] = {
        'resumed_from': results['resumed_from'], 'steps': results['steps'],
        'history': [{k: record[k] for k in ('step', 'loss', 'accuracy')}
                    for record in results['history']],
        'translations': translate(resumed, test, 'latest')}
  with open(os.path.join(out, 'expected.json'), 'w', encoding='utf-8') as f:
    json.dump(expected, f, indent=1)


if __name__ == '__main__':
  main(os.path.abspath(sys.argv[1]))
