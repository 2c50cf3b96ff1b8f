from django.core.management.base import BaseCommand

from jobs.reconcile import reconcile


class Command(BaseCommand):
    help = "Re-enqueue stalled offline chunks and finish jobs with nothing left to run (the worker also does this periodically)."

    def add_arguments(self, parser):
        parser.add_argument("--stall-s", type=float, default=None, help="override JOBS_STALL_S")

    def handle(self, *args, **options):
        self.stdout.write(str(reconcile(options["stall_s"])))
